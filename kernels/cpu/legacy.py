"""Legacy block types (32 weights per block): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each type has `dequantize_<t>(raw, out, lanes)` and `matvec_<t>(raw, xq, xd, xs, out, lanes)`:
raw uint8 (n_rows, n_blocks * type_size), out float32 (n_rows, n_cols) or (n_rows,);
(xq, xd, xs) is x quantized by common.quantize_x; lanes = common.LANES (16).
Block j of a row starts at byte j * type_size; its weights are columns 32j .. 32j+31.
Nibble order (Q4/Q5): byte i of qs holds weight i (low nibble) and weight i + 16 (high nibble).

Matvec per block, with q the stored unsigned integer, x_i ~= xd * xq_i, S = sum(xq) over the block:
    Q4_0: d * xd * (sum(q * xq) - 8 * S)          Q4_1: xd * (d * sum(q * xq) + m * S)
    Q5_0: d * xd * (sum(q * xq) - 16 * S)         Q5_1: as Q4_1, q has 5 bits
    Q8_0: d * xd * sum(q * xq), q signed
Dequantize follows gguf.quants operation for operation (no fast-math), so it is bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import (F32, FAST_IN_ORDER, I32, JIT, U, QuantizedOps,
                                        dot16_bits, dot16_field, dot16_i8, f16_to_f32, njit,
                                        prange)

# Bytes per block, as the sum of its fields.
Q4_0_BYTES = 2 + 16  # d | qs[16]
Q4_1_BYTES = 2 + 2 + 16  # d m | qs[16]
Q5_0_BYTES = 2 + 4 + 16  # d | qh (u32, bit i = 5th bit of weight i) | qs[16]
Q5_1_BYTES = 2 + 2 + 4 + 16  # d m | qh | qs[16]
Q8_0_BYTES = 2 + 32  # d | qs: i8[32]


@njit(inline="always")
def _u32(row, o):
    return (U(row[o]) | (U(row[o + U(1)]) << U(8)) | (U(row[o + U(2)]) << U(16))
            | (U(row[o + U(3)]) << U(24)))


# --- dequantize ----------------------------------------------------------------------------
@njit(**JIT)
def dequantize_q4_0(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(Q4_0_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            for j in range(lanes):
                q = I32(row[o + U(2) + j])
                dst[w + j] = d * F32((q & I32(15)) - I32(8))
                dst[w + U(16) + j] = d * F32((q >> I32(4)) - I32(8))


@njit(**JIT)
def dequantize_q4_1(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(Q4_1_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            m = f16_to_f32(row[o + U(2)], row[o + U(3)])
            for j in range(lanes):
                q = I32(row[o + U(4) + j])
                dst[w + j] = d * F32(q & I32(15)) + m
                dst[w + U(16) + j] = d * F32(q >> I32(4)) + m


@njit(**JIT)
def dequantize_q5_0(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(Q5_0_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            qh = _u32(row, o + U(2))
            for j in range(lanes):
                q = I32(row[o + U(6) + j])
                lo = (q & I32(15)) | (I32((qh >> j) & U(1)) << I32(4))
                hi = (q >> I32(4)) | (I32((qh >> (j + U(16))) & U(1)) << I32(4))
                dst[w + j] = d * F32(lo - I32(16))
                dst[w + U(16) + j] = d * F32(hi - I32(16))


@njit(**JIT)
def dequantize_q5_1(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(Q5_1_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            m = f16_to_f32(row[o + U(2)], row[o + U(3)])
            qh = _u32(row, o + U(4))
            for j in range(lanes):
                q = I32(row[o + U(8) + j])
                lo = (q & I32(15)) | (I32((qh >> j) & U(1)) << I32(4))
                hi = (q >> I32(4)) | (I32((qh >> (j + U(16))) & U(1)) << I32(4))
                dst[w + j] = d * F32(lo) + m
                dst[w + U(16) + j] = d * F32(hi) + m


@njit(**JIT)
def dequantize_q8_0(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(Q8_0_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            for j in range(lanes + lanes):
                dst[w + j] = F32(np.int8(row[o + U(2) + j])) * d


# --- matvec --------------------------------------------------------------------------------
@njit(fastmath=FAST_IN_ORDER, **JIT)
def matvec_q4_0(raw, xq, xd, xs, out, lanes):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for b in range(U(xq.size // 32)):
            o, w = b * U(Q4_0_BYTES), b * U(32)
            s = dot16_field(row, o + U(2), I32(0), I32(15), xq, w) \
                + dot16_field(row, o + U(2), I32(4), I32(15), xq, w + U(16))
            sx = xs[b + b] + xs[b + b + U(1)]
            acc += f16_to_f32(row[o], row[o + U(1)]) * xd[b] * F32(s - I32(8) * sx)
        out[r] = acc


@njit(fastmath=FAST_IN_ORDER, **JIT)
def matvec_q4_1(raw, xq, xd, xs, out, lanes):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for b in range(U(xq.size // 32)):
            o, w = b * U(Q4_1_BYTES), b * U(32)
            s = dot16_field(row, o + U(4), I32(0), I32(15), xq, w) \
                + dot16_field(row, o + U(4), I32(4), I32(15), xq, w + U(16))
            d = f16_to_f32(row[o], row[o + U(1)])
            m = f16_to_f32(row[o + U(2)], row[o + U(3)])
            acc += xd[b] * (d * F32(s) + m * F32(xs[b + b] + xs[b + b + U(1)]))
        out[r] = acc


@njit(fastmath=FAST_IN_ORDER, **JIT)
def matvec_q5_0(raw, xq, xd, xs, out, lanes):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for b in range(U(xq.size // 32)):
            o, w = b * U(Q5_0_BYTES), b * U(32)
            qh = I32(_u32(row, o + U(2)) & U(0xFFFF))
            qh_hi = I32(_u32(row, o + U(2)) >> U(16))
            s = dot16_field(row, o + U(6), I32(0), I32(15), xq, w) \
                + dot16_field(row, o + U(6), I32(4), I32(15), xq, w + U(16)) \
                + I32(16) * (dot16_bits(qh, xq, w) + dot16_bits(qh_hi, xq, w + U(16)))
            sx = xs[b + b] + xs[b + b + U(1)]
            acc += f16_to_f32(row[o], row[o + U(1)]) * xd[b] * F32(s - I32(16) * sx)
        out[r] = acc


@njit(fastmath=FAST_IN_ORDER, **JIT)
def matvec_q5_1(raw, xq, xd, xs, out, lanes):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for b in range(U(xq.size // 32)):
            o, w = b * U(Q5_1_BYTES), b * U(32)
            qh = I32(_u32(row, o + U(4)) & U(0xFFFF))
            qh_hi = I32(_u32(row, o + U(4)) >> U(16))
            s = dot16_field(row, o + U(8), I32(0), I32(15), xq, w) \
                + dot16_field(row, o + U(8), I32(4), I32(15), xq, w + U(16)) \
                + I32(16) * (dot16_bits(qh, xq, w) + dot16_bits(qh_hi, xq, w + U(16)))
            d = f16_to_f32(row[o], row[o + U(1)])
            m = f16_to_f32(row[o + U(2)], row[o + U(3)])
            acc += xd[b] * (d * F32(s) + m * F32(xs[b + b] + xs[b + b + U(1)]))
        out[r] = acc


@njit(fastmath=FAST_IN_ORDER, **JIT)
def matvec_q8_0(raw, xq, xd, xs, out, lanes):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for b in range(U(xq.size // 32)):
            o, w = b * U(Q8_0_BYTES), b * U(32)
            s = dot16_i8(row, o + U(2), xq, w) + dot16_i8(row, o + U(18), xq, w + U(16))
            acc += f16_to_f32(row[o], row[o + U(1)]) * xd[b] * F32(s)
        out[r] = acc


OPS = QuantizedOps({
    GGMLType.Q4_0: (dequantize_q4_0, matvec_q4_0),
    GGMLType.Q4_1: (dequantize_q4_1, matvec_q4_1),
    GGMLType.Q5_0: (dequantize_q5_0, matvec_q5_0),
    GGMLType.Q5_1: (dequantize_q5_1, matvec_q5_1),
    GGMLType.Q8_0: (dequantize_q8_0, matvec_q8_0),
})
