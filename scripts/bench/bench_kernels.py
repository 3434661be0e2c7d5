"""Benchmark the CPU kernels: matvec weight bandwidth per type vs. a NumPy sum over the same bytes.

    python scripts/bench/bench_kernels.py [--types Q4_0,Q8_0] [--threads N] [--working-set-mb 192]
                                    [--shapes] [--no-types] [--vs-ggml]

For each type: a 4096 x 4096 matrix of random valid blocks, repeated until the working set exceeds
--working-set-mb (so matvec streams from memory, as in decode, not from the last-level cache; pass
0 for a single copy). Columns: GB/s of weight bytes matvec streams, GB/s of `uint64.sum()` over
the same buffers (NumPy, one thread: the machine's streaming bandwidth), the ratio, and matmul
GFLOP/s for n_tok = 512 on one copy. Runs alternate kernel / sum; medians are reported.

--shapes adds the real model shapes (SmolLM2-135M: 576x576, 1536x576, 576x1536, 49152x576):
per-call decode cost (bound matvec incl. x conversion and Python, vs. the bare kernel), and
prefill (n_tok = 512): BLAS GFLOP/s on float32 weights vs. the whole cpu.matmul (x conversion,
tile dequantization, BLAS).

--vs-ggml (dev only, needs llama-cpp-python): checks parity with llama.cpp's own CPU library:
its activation conversions (from_float of Q8_0 / Q8_1 / Q8_K) against cpu.quantize bit for bit,
and its vec_dot per weight type against cpu.matvec.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from quant_blocks import random_rows  # noqa: E402

from edgellm.kernels import cpu  # noqa: E402

N = 4096


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_type(t, working_set: int, reps: int, matmul_reps: int) -> tuple[float, float, float]:
    first = random_rows(t, N, N, seed=0)
    copies = [first] + [np.roll(first, k, axis=0) for k in range(1, -(-working_set // first.nbytes))]
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    out = np.empty(N, np.float32)
    words = [c.reshape(-1).view(np.uint64) for c in copies]
    total = sum(c.nbytes for c in copies)

    def run_matvec():
        for c in copies:
            cpu.matvec(t, c, x, out)

    def run_sum():
        for w in words:
            w.sum()

    run_matvec()  # compile / load from cache
    mv, sm = [], []
    for _ in range(reps):  # alternate, so both see the same machine load
        mv.append(median_time(run_matvec, 1))
        sm.append(median_time(run_sum, 1))
    xs = np.random.default_rng(2).standard_normal((512, N)).astype(np.float32)
    prod = np.empty((512, N), np.float32)
    cpu.matmul(t, first, xs[:2], prod[:2])
    mm = median_time(lambda: cpu.matmul(t, first, xs, prod), matmul_reps)
    return total / np.median(mv) / 1e9, total / np.median(sm) / 1e9, 2.0 * 512 * N * N / mm / 1e9


def bench_shapes(t, reps: int) -> None:
    for n_rows, n_cols in [(576, 576), (1536, 576), (576, 1536), (49152, 576)]:
        raw = random_rows(t, n_rows, n_cols, seed=3)
        m = cpu.bind(t, raw)
        x = np.random.default_rng(4).standard_normal(n_cols).astype(np.float32)
        out = np.empty(n_rows, np.float32)
        xa = cpu.quantize(m.act_format, x)
        m.matvec(x, out)
        bound = median_time(lambda: m.matvec(x, out), reps * 20)
        bare = median_time(lambda: m.matvec_act(xa, out), reps * 20)
        xs = np.random.default_rng(5).standard_normal((512, n_cols)).astype(np.float32)
        prod = np.empty((512, n_rows), np.float32)
        w = np.empty((n_rows, n_cols), np.float32)
        m.dequantize(w)
        flops = 2.0 * 512 * n_rows * n_cols
        blas = median_time(lambda: np.matmul(xs, w.T, out=prod), reps)
        full = median_time(lambda: m.matmul(xs, prod), reps)
        print(f"{t.name:6} {n_rows:>5}x{n_cols:<5} matvec {1e6 * bound:8.1f} us (kernel {1e6 * bare:8.1f}, "
              f"{raw.nbytes / bare / 1e9:5.2f} GB/s)   matmul 512: BLAS {flops / blas / 1e9:6.1f} GFLOP/s, "
              f"cpu.matmul {flops / full / 1e9:6.1f} GFLOP/s", flush=True)


def check_vs_ggml(n: int = 2048, n_rows: int = 16) -> None:
    """Parity with the ggml CPU library that llama-cpp-python ships (see the module docstring)."""
    import ctypes

    import llama_cpp
    from gguf import GGMLQuantizationType as GGMLType

    libdir = Path(llama_cpp.__file__).parent / "lib"
    ctypes.CDLL(str(libdir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(libdir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    vec_dot_t = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)

    class Traits(ctypes.Structure):  # struct ggml_type_traits_cpu
        _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                    ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]

    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(Traits)
    lib.ggml_cpu_init()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-3, 2, n)).astype(np.float32)
    x[96:128] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)  # ties

    def converted(vec_dot_type: int) -> np.ndarray:
        block, size = {8: (32, 34), 9: (32, 36), 15: (256, 292), 1: (1, 2), 30: (1, 2)}[vec_dot_type]
        buf = np.zeros(n // block * size, np.uint8)
        from_float_t(lib.ggml_get_type_traits_cpu(vec_dot_type).contents.from_float)(
            x.ctypes.data, buf.ctypes.data, n)
        return buf.reshape(-1, size)

    q8_0, q8_1, q8_k = converted(8), converted(9), converted(15)
    ours = cpu.quantize("q8_32", x).parts
    same = (np.array_equal(q8_0[:, 2:].view(np.int8).reshape(-1), ours[0])
            and np.array_equal(q8_0[:, :2].copy().view(np.float16)[:, 0].astype(np.float32), ours[1])
            and np.array_equal(q8_1[:, 2:4].copy().view(np.float16)[:, 0].astype(np.float32), ours[3]))
    print(f"Q8_0 / Q8_1 activations bit-identical to ggml: {same}")
    ours = cpu.quantize("q8_k", x).parts
    same = (np.array_equal(q8_k[:, :4].copy().view(np.float32)[:, 0], ours[1])
            and np.array_equal(q8_k[:, 4:260].copy().view(np.int8).reshape(-1), ours[0])
            and np.array_equal(q8_k[:, 260:].copy().view(np.int16).reshape(-1), ours[2]))
    print(f"Q8_K activations bit-identical to ggml: {same}")
    for t in cpu.supported_types():
        if t == GGMLType.F32:
            continue
        raw = random_rows(t, n_rows, n, seed=int(t))
        traits = lib.ggml_get_type_traits_cpu(int(t)).contents
        xb = converted(traits.vec_dot_type)
        ref, s = np.empty(n_rows, np.float32), ctypes.c_float()
        for r in range(n_rows):
            row = np.ascontiguousarray(raw[r])
            vec_dot_t(traits.vec_dot)(n, ctypes.addressof(s), 0, row.ctypes.data, 0, xb.ctypes.data, 0, 1)
            ref[r] = s.value
        out = np.empty(n_rows, np.float32)
        cpu.matvec(t, raw, x, out)
        print(f"{t.name:5} max |matvec - ggml vec_dot| / max |ggml| = "
              f"{np.max(np.abs(out - ref)) / np.max(np.abs(ref)):.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default=",".join(t.name for t in cpu.supported_types()))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--working-set-mb", type=float, default=192.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--matmul-reps", type=int, default=3)
    p.add_argument("--shapes", action="store_true", help="also time the real model shapes")
    p.add_argument("--no-types", action="store_true", help="skip the 4096x4096 bandwidth table")
    p.add_argument("--vs-ggml", action="store_true", help="check parity with llama.cpp's CPU library")
    args = p.parse_args()
    from gguf import GGMLQuantizationType as GGMLType

    if args.threads:
        cpu.set_threads(args.threads)
    if args.vs_ggml:
        check_vs_ggml()
    import numba

    print(f"matvec {N}x{N}, working set >= {args.working_set_mb:g} MB, "
          f"{numba.get_num_threads()} Numba threads; numpy sum is single-threaded")
    print(f"{'type':6} {'matvec GB/s':>12} {'numpy sum GB/s':>15} {'ratio':>7} {'matmul n_tok=512 GFLOP/s':>26}")
    for name in ([] if args.no_types else args.types.split(",")):
        t = GGMLType[name.strip()]
        mv, sm, gflops = bench_type(t, int(args.working_set_mb * 2**20), args.reps, args.matmul_reps)
        print(f"{t.name:6} {mv:12.2f} {sm:15.2f} {100 * mv / sm:6.0f}% {gflops:26.1f}", flush=True)
    if args.shapes:
        for name in ("Q4_1", "Q8_0"):
            bench_shapes(GGMLType[name], args.matmul_reps)


if __name__ == "__main__":
    main()
