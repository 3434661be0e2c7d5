"""Random valid raw rows for every GGML type: random bits everywhere, finite float scales.

Scales (the f16 / bf16 / f32 fields of a block) are drawn from a modest range so that products
stay finite; every other byte (nibbles, high bits, packed 6-bit scales, int8 values) is uniform.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.quants import QUANT_TYPES

# Byte offsets of the f16 fields inside one block, per type.
F16_FIELDS = {
    GGMLType.Q4_0: (0,),
    GGMLType.Q4_1: (0, 2),
    GGMLType.Q5_0: (0,),
    GGMLType.Q5_1: (0, 2),
    GGMLType.Q8_0: (0,),
    GGMLType.Q2_K: (16 + 64, 16 + 64 + 2),  # after scales[16] | qs[64]: d, dmin
    GGMLType.Q3_K: (32 + 64 + 12,),  # after hmask[32] | qs[64] | scales[12]: d
    GGMLType.Q4_K: (0, 2),
    GGMLType.Q5_K: (0, 2),
    GGMLType.Q6_K: (128 + 64 + 16,),  # after ql[128] | qh[64] | scales[16]: d
    GGMLType.IQ4_NL: (0,),
    GGMLType.IQ4_XS: (0,),
    GGMLType.IQ2_XXS: (0,),
    GGMLType.IQ2_XS: (0,),
    GGMLType.IQ2_S: (0,),
    GGMLType.IQ3_XXS: (0,),
    GGMLType.IQ3_S: (0,),
    GGMLType.TQ1_0: (52,),
    GGMLType.TQ2_0: (64,),
    GGMLType.IQ1_S: (0,),
    GGMLType.IQ1_M: (),  # d is spread over the scales' top nibbles: random bits
}


def _scales(rng, n: int) -> np.ndarray:
    """Finite float scales of both signs, magnitudes 1e-3 .. 1."""
    return (rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-3, 0, n)).astype(np.float32)


def random_rows(ggml_type: GGMLType, n_rows: int, n_cols: int, seed: int = 0) -> np.ndarray:
    """uint8 (n_rows, row_bytes) of valid random blocks of `ggml_type`."""
    rng = np.random.default_rng(seed)
    qt = QUANT_TYPES[ggml_type]
    if ggml_type == GGMLType.F32:
        return _scales(rng, n_rows * n_cols).view(np.uint8).reshape(n_rows, -1)
    if ggml_type == GGMLType.F16:
        return _scales(rng, n_rows * n_cols).astype(np.float16).view(np.uint8).reshape(n_rows, -1)
    if ggml_type == GGMLType.BF16:
        bits = _scales(rng, n_rows * n_cols).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8).reshape(n_rows, -1)
    n_blocks = n_rows * n_cols // qt.block_size
    blocks = rng.integers(0, 256, (n_blocks, qt.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        blocks[:, offset:offset + 2] = _scales(rng, n_blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if ggml_type == GGMLType.IQ1_M:
        set_iq1_m_d(blocks, _scales(rng, n_blocks))
    return blocks.reshape(n_rows, qt.row_bytes(n_cols))


def set_iq1_m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """Write fp16(d) into IQ1_M blocks (n, 56): its four nibbles are the top nibbles of the four
    u16 scales (bytes 49, 51, 53, 55)."""
    h = d.astype(np.float16).view(np.uint16).astype(np.int64)
    for k in range(4):
        b = 49 + 2 * k
        blocks[:, b] = (blocks[:, b] & 0x0F) | (((h >> (4 * k)) & 0x0F) << 4).astype(np.uint8)


# --- NumPy reimplementations of ggml's CPU activation conversions (x86 / AVX2 rounding) ---------
def f16_round(a) -> np.ndarray:
    """float32 -> nearest half (ties to even) -> float32."""
    with np.errstate(over="ignore"):  # beyond the half range: inf, as in ggml
        return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def bf16_round(a) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even; nan stays nan) -> float32."""
    u = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, (u >> 16) | 64, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
    return (r.astype(np.uint32) << 16).view(np.float32)


def ref_q8_32(x: np.ndarray):
    """ggml quantize_row_q8_0 / q8_1 (AVX2): (q int8, d = fp16(amax/127), sum(q), fp16(d * sum(q)))."""
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[:, None]).astype(np.int8)
    s = q.astype(np.int32).sum(axis=1)
    return q.reshape(-1), f16_round(d), s, f16_round(d * s.astype(np.float32))


def ref_q8_k(x: np.ndarray):
    """ggml quantize_row_q8_K_ref: (q int8, d float32 per 256, sums of q per 16)."""
    xb = x.reshape(-1, 256)
    vmax = xb[np.arange(xb.shape[0]), np.abs(xb).argmax(axis=1)]  # first of largest magnitude
    zero = vmax == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0.0), np.float32(-127.0) / vmax).astype(np.float32)
        d = np.where(zero, np.float32(0.0), np.float32(1.0) / iscale).astype(np.float32)
    q = np.minimum(np.rint(xb * iscale[:, None]), 127).astype(np.int8)
    return q.reshape(-1), d, q.astype(np.int32).reshape(-1, 16).sum(axis=1)
