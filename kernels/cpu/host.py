"""What the CPU the kernels are compiled for can do: one probe, read by every module that chooses
a code path by it (the IR builders, the kernels, the backend).

NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, when set, are what LLVM compiles for, so they are what counts
here (a generic CPU name: portable IR only, no half conversion instructions assumed).
"""
from __future__ import annotations

import numba
from llvmlite import binding as llvm_binding


def _features() -> set[str]:
    if numba.config.CPU_NAME not in (None, "host"):
        return set()  # cross-compiling for a generic CPU: portable IR only
    # NUMBA_CPU_FEATURES, when set, is what LLVM compiles for (e.g. the host less AVX-512)
    flat = numba.config.CPU_FEATURES or llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f[:1] == "+"}


FEATURES = frozenset(_features())
AVX2 = "avx2" in FEATURES
# vpdpbusd: four u8 x s8 products summed into each int32 lane in one instruction (AVX-VNNI, or
# AVX-512 VNNI with 256-bit forms)
VNNI = AVX2 and ("avxvnni" in FEATURES or {"avx512vnni", "avx512vl"} <= FEATURES)
# AVX-512 with 256-bit forms: 32 vector registers (AVX2 has 16), room for constants kept in them
REGS32 = AVX2 and {"avx512f", "avx512vl"} <= FEATURES
# 512-bit byte ops and vpdpbusd (two tokens' blocks in one vector: ir.tiles.rowdot2xn_q8_0)
ZMM_VNNI = REGS32 and {"avx512bw", "avx512vnni"} <= FEATURES
# LLVM's name for the CPU compiled for: "znver1" .. "znver5" on AMD Zen.
CPU_NAME = (llvm_binding.get_host_cpu_name() if numba.config.CPU_NAME in (None, "host") else numba.config.CPU_NAME)
# Software prefetch of the weights a decode kernel reads next (ir.builder.ROW_AHEAD,
# ir.packed.PACKED_AHEAD, ir.rows8.GROUP_AHEAD): on Intel cores it keeps the one-row K-quant kernels
# from being latency-bound; on AMD Zen cores it costs instead (docs/performance.md, decisions).
SOFTWARE_PREFETCH = not CPU_NAME.startswith("znver")
# Half <-> float conversion instructions (x86 F16C, or any AArch64): the kernels convert f16 in
# vector code and attention reads an f16 KV cache directly; without them the backend's twins run.
F16C = "f16c" in FEATURES or "fp-armv8" in FEATURES or "neon" in FEATURES
