"""One record per tensor type the CPU kernels take: the tables of this package (the family a type's
kernels live in, the activation format, ggml's Q8_1 vec_dot types, the fused decode step's types)
are derived from these. Block sizes and byte counts come from `edgellm.quants`.

Adding a type: docs/internals.md ("Adding a tensor type").
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T


@dataclass(frozen=True)
class CPUType:
    ggml_type: T
    family: str | None  # the module of this package with its `KERNELS` / `MATMUL` (None: F32, plain NumPy)
    act: str  # the format x is converted to for its products (common.py): f32 f16 bf16 q8_32 q8_k
    q8_1: bool = False  # ggml's vec_dot_type is Q8_1 (Q8_0 plus the block's fp16 d * sum(q))
    fused: bool = False  # the fused decode step has a row kernel for it (fused.ROW_ORDER)


TYPES: dict[T, CPUType] = {r.ggml_type: r for r in (
    CPUType(T.F32, None, "f32"),
    CPUType(T.F16, "dense", "f16"),
    CPUType(T.BF16, "dense", "bf16"),
    CPUType(T.Q4_0, "legacy", "q8_32", fused=True),
    CPUType(T.Q4_1, "legacy", "q8_32", q8_1=True, fused=True),
    CPUType(T.Q5_0, "legacy", "q8_32", fused=True),
    CPUType(T.Q5_1, "legacy", "q8_32", q8_1=True, fused=True),
    CPUType(T.Q8_0, "legacy", "q8_32", fused=True),
    CPUType(T.Q2_K, "kquants", "q8_k", fused=True),
    CPUType(T.Q3_K, "kquants", "q8_k", fused=True),
    CPUType(T.Q4_K, "kquants", "q8_k", fused=True),
    CPUType(T.Q5_K, "kquants", "q8_k", fused=True),
    CPUType(T.Q6_K, "kquants", "q8_k", fused=True),
    CPUType(T.IQ4_NL, "iquants", "q8_32"),
    CPUType(T.IQ4_XS, "iquants", "q8_k"),
    CPUType(T.IQ2_XXS, "igrid", "q8_k"),
    CPUType(T.IQ2_XS, "igrid", "q8_k"),
    CPUType(T.IQ2_S, "igrid", "q8_k"),
    CPUType(T.IQ3_XXS, "igrid", "q8_k"),
    CPUType(T.IQ3_S, "igrid", "q8_k"),
    CPUType(T.TQ1_0, "igrid", "q8_k"),
    CPUType(T.TQ2_0, "igrid", "q8_k"),
    CPUType(T.IQ1_S, "igrid", "q8_k"),
    CPUType(T.IQ1_M, "igrid", "q8_k"),
)}

ACT_BLOCK = {"f32": 1, "f16": 1, "bf16": 1, "q8_32": 32, "q8_k": 256}  # values per activation block
Q8_1_WEIGHTS = frozenset(t for t, r in TYPES.items() if r.q8_1)
FUSED_TYPES = frozenset(int(t) for t, r in TYPES.items() if r.fused)  # ints, as decode plans hold them
