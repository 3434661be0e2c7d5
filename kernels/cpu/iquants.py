"""The 4-bit non-linear types: IQ4_NL (blocks of 32, activations "q8_32") and IQ4_XS (super-blocks
of 256, activations "q8_k").

Same entry points as legacy.py / kquants.py: `dequantize_<t>(raw, out, lanes)`,
`matvec_<t>(raw, xq, xd, xs, xm, out)` and a batch product in MATMUL. A 4-bit code q stands for
the signed 8-bit value KVALUES[q] (ggml's kvalues_iq4nl); byte i of a 16-byte group holds weight
i (low nibble) and weight i + 16 (high nibble), as in Q4_0.

    IQ4_NL  d:f16 | qs:u8[16]                                  w = d * KVALUES[q]
    IQ4_XS  d:f16 | scales_h:u16 | scales_l:u8[4] | qs:u8[128]; sub-block s (32 weights, qs[16s:16s+16]):
            ls = (nibble s % 2 of scales_l[s // 2]) | ((scales_h >> 2s) & 3) << 4
            w = (d * (ls - 32)) * KVALUES[q]

The products sum in the order of what llama.cpp's AVX2 CPU build runs for the matrix (the integer
sums are exact, so only the float steps below are order-sensitive; reference.py spells each out):
  IQ4_NL, row count a multiple of 8 (llama.cpp repacks it, iq4_nl_8x8; gemv and gemm alike):
      per block acc = fma(f32(isum), d_w * d_x, acc)
  IQ4_NL, other row counts: one token as ggml_vec_dot_iq4_nl_q8_0 (even and odd blocks in two
      8-lane accumulators, lane j the sum of weights 4j..4j+3; hsum_float_8 of their sum; an odd
      last block added as fma(d_x * d_w, f32(isum), sum)); two or more tokens as tinyBLAS (one
      8-lane accumulator, fma(d_w * d_x, lanes, acc); hsum)
  IQ4_XS, fewer than 8 tokens: ggml_vec_dot_iq4_xs_q8_K (per super-block 8 integer lanes
      sum_s (ls_s - 32) * quad sums, acc = fma(d_w * d_x, f32(lanes), acc); hsum_float_8)
  IQ4_XS, 8 tokens or more: llama.cpp's tiled kernel: per super-block res = d_w * f32(s1),
      acc = fma(res, d_x, acc), s1 the super-block's exact scaled integer sum
Dequantize follows gguf.quants operation for operation: bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, I32, JIT, U, f16_to_f32, fma32, load_f16, njit, prange

KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int32)

# Bytes per block, as the sum of its fields.
IQ4_NL_BYTES = 2 + 16  # d | qs[16]
IQ4_XS_BYTES = 2 + 2 + 4 + 128  # d | scales_h (u16) | scales_l[4] | qs[128]
TILED_MIN = 8  # IQ4_XS batches from this many tokens on take llama.cpp's tiled order
REPACK_ROWS = 8  # IQ4_NL matrices with a multiple of this many rows are repacked by llama.cpp


@njit(inline="always")
def _xs_scale(row, o, s):
    """ls - 32 of sub-block s (0..7) of the IQ4_XS super-block at byte o."""
    sh = I32(row[o + U(2)]) | (I32(row[o + U(3)]) << I32(8))
    lo = (I32(row[o + U(4) + (s >> U(1))]) >> I32(4 * (s & U(1)))) & I32(15)
    return (lo | (((sh >> I32(2 * s)) & I32(3)) << I32(4))) - I32(32)


@njit(inline="always")
def _quad(row, q, xq, x, lane):
    """sum of KVALUES[code] * x over weights 4 lane .. 4 lane + 3 (lane 0..7) of the 16 code bytes at
    row[q:] and the 32 activations at xq[x:] (exact int32)."""
    s = I32(0)
    if lane < U(4):
        for i in range(U(4)):
            s += KVALUES[row[q + U(4) * lane + i] & U(15)] * I32(xq[x + U(4) * lane + i])
    else:
        for i in range(U(4)):
            s += KVALUES[row[q + U(4) * (lane - U(4)) + i] >> U(4)] * I32(xq[x + U(4) * lane + i])
    return s


@njit(inline="always")
def _dot32(row, q, xq, x):
    """sum of KVALUES[code] * x over the 32 weights of the 16 code bytes at row[q:] (exact int32)."""
    s = I32(0)
    for i in range(U(16)):
        c = row[q + i]
        s += KVALUES[c & U(15)] * I32(xq[x + i]) + KVALUES[c >> U(4)] * I32(xq[x + U(16) + i])
    return s


@njit(inline="always")
def hsum8(a):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    r0, r1, r2, r3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
    return (r0 + r2) + (r1 + r3)


# --- dequantize ----------------------------------------------------------------------------
@njit(**JIT)
def dequantize_iq4_nl(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(IQ4_NL_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            for j in range(lanes):
                c = row[o + U(2) + j]
                dst[w + j] = d * F32(KVALUES[c & U(15)])
                dst[w + U(16) + j] = d * F32(KVALUES[c >> U(4)])


@njit(**JIT)
def dequantize_iq4_xs(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 256)):
            o, w = b * U(IQ4_XS_BYTES), b * U(256)
            d = f16_to_f32(row[o], row[o + U(1)])
            for s in range(U(8)):
                dl = d * F32(_xs_scale(row, o, s))
                q = o + U(8) + U(16) * s
                for j in range(lanes):
                    c = row[q + j]
                    dst[w + U(32) * s + j] = dl * F32(KVALUES[c & U(15)])
                    dst[w + U(32) * s + U(16) + j] = dl * F32(KVALUES[c >> U(4)])


# --- IQ4_NL row dot products (x: "q8_32" parts, token t's blocks at t * nb ...) ------------------
@njit(inline="always")
def row_iq4_nl_repacked(row, xq, xd, t, nb):
    """llama.cpp's repacked order (iq4_nl_8x8 gemv / gemm): acc = fma(f32(isum), d_w * d_x, acc)."""
    acc = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        acc = fma32(F32(_dot32(row, o + U(2), xq, b * U(32))), load_f16(row, o) * xd[b], acc)
    return acc


@njit(inline="always")
def row_iq4_nl_vec_dot(row, xq, xd, t, nb, a1, a2):
    """ggml_vec_dot_iq4_nl_q8_0 (AVX2): blocks 2i into a1, 2i + 1 into a2 (8 lanes each, scratch),
    hsum_float_8(a1 + a2), then an odd last block as a scalar fma."""
    for lane in range(8):
        a1[lane] = F32(0.0)
        a2[lane] = F32(0.0)
    j = U(0)
    while j + U(1) < nb:
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        d1 = load_f16(row, o) * xd[b]
        d2 = load_f16(row, o + U(IQ4_NL_BYTES)) * xd[b + U(1)]
        for lane in range(U(8)):
            a1[lane] = fma32(d1, F32(_quad(row, o + U(2), xq, b * U(32), lane)), a1[lane])
            a2[lane] = fma32(d2, F32(_quad(row, o + U(IQ4_NL_BYTES + 2), xq, (b + U(1)) * U(32), lane)), a2[lane])
        j += U(2)
    for lane in range(8):
        a1[lane] = a1[lane] + a2[lane]
    s = hsum8(a1)
    if j < nb:
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        s = fma32(xd[b] * load_f16(row, o), F32(_dot32(row, o + U(2), xq, b * U(32))), s)
    return s


@njit(inline="always")
def row_iq4_nl_tinyblas(row, xq, xd, t, nb, a1):
    """tinyBLAS_Q0_AVX (llama.cpp's batches of unrepacked IQ4_NL): one 8-lane accumulator,
    acc = fma(d_w * d_x, lanes, acc) per block; hsum."""
    for lane in range(8):
        a1[lane] = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        d = load_f16(row, o) * xd[b]
        for lane in range(U(8)):
            a1[lane] = fma32(d, F32(_quad(row, o + U(2), xq, b * U(32), lane)), a1[lane])
    return hsum8(a1)


@njit(**JIT)
def matvec_iq4_nl(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    n = raw.shape[0]
    if n % REPACK_ROWS == 0:
        for r in prange(n):
            out[r] = row_iq4_nl_repacked(raw[r], xq, xd, U(0), nb)
    else:
        for c in prange((n + 15) // 16):
            a1, a2 = np.empty(8, F32), np.empty(8, F32)
            for r in range(c * 16, min(c * 16 + 16, n)):
                out[r] = row_iq4_nl_vec_dot(raw[r], xq, xd, U(0), nb, a1, a2)


@njit(**JIT)
def matmul_iq4_nl(raw, xq, xd, xs, xm, out):
    """out (n_tok, n_rows); x the tokens' "q8_32" parts end to end. Rows by chunks of 16, every
    token over a chunk while its weights are in the cache."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    repacked = n_rows % REPACK_ROWS == 0
    for c in prange((n_rows + 15) // 16):
        a1, a2 = np.empty(8, F32), np.empty(8, F32)
        for t in range(n_tok):
            for r in range(c * 16, min(c * 16 + 16, n_rows)):
                if repacked:
                    out[t, r] = row_iq4_nl_repacked(raw[r], xq, xd, U(t), nb)
                elif n_tok == 1:
                    out[t, r] = row_iq4_nl_vec_dot(raw[r], xq, xd, U(t), nb, a1, a2)
                else:
                    out[t, r] = row_iq4_nl_tinyblas(raw[r], xq, xd, U(t), nb, a1)


# --- IQ4_XS row dot products (x: "q8_k" parts, token t's super-blocks at t * nb ...) ---------------
@njit(inline="always")
def row_iq4_xs_vec_dot(row, xq, xd, t, nb, acc):
    """ggml_vec_dot_iq4_xs_q8_K (AVX2): per super-block 8 integer lanes sum_s (ls_s - 32) * quad,
    acc = fma(d_w * d_x, f32(lanes), acc) (8 lanes, scratch); hsum_float_8."""
    for lane in range(8):
        acc[lane] = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_XS_BYTES)
        d = load_f16(row, o) * xd[b]
        for lane in range(U(8)):
            s = I32(0)
            for sb in range(U(8)):
                s += _xs_scale(row, o, sb) * _quad(row, o + U(8) + U(16) * sb, xq, b * U(256) + U(32) * sb, lane)
            acc[lane] = fma32(d, F32(s), acc[lane])
    return hsum8(acc)


@njit(inline="always")
def row_iq4_xs_tiled(row, xq, xd, t, nb):
    """llama.cpp's tiled order: per super-block res = d_w * f32(s1), acc = fma(res, d_x, acc)."""
    acc = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_XS_BYTES)
        s1 = I32(0)
        for sb in range(U(8)):
            s1 += _xs_scale(row, o, sb) * _dot32(row, o + U(8) + U(16) * sb, xq, b * U(256) + U(32) * sb)
        acc = fma32(load_f16(row, o) * F32(s1), xd[b], acc)
    return acc


@njit(**JIT)
def matvec_iq4_xs(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    n = raw.shape[0]
    for c in prange((n + 15) // 16):
        acc = np.empty(8, F32)
        for r in range(c * 16, min(c * 16 + 16, n)):
            out[r] = row_iq4_xs_vec_dot(raw[r], xq, xd, U(0), nb, acc)


@njit(**JIT)
def matmul_iq4_xs(raw, xq, xd, xs, xm, out):
    """out (n_tok, n_rows); x the tokens' "q8_k" parts end to end: the tiled order from TILED_MIN
    tokens on, the one-token order below."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    tiled = n_tok >= TILED_MIN
    for c in prange((n_rows + 15) // 16):
        acc = np.empty(8, F32)
        for t in range(n_tok):
            for r in range(c * 16, min(c * 16 + 16, n_rows)):
                if tiled:
                    out[t, r] = row_iq4_xs_tiled(raw[r], xq, xd, U(t), nb)
                else:
                    out[t, r] = row_iq4_xs_vec_dot(raw[r], xq, xd, U(t), nb, acc)


KERNELS = {
    GGMLType.IQ4_NL: (dequantize_iq4_nl, matvec_iq4_nl),
    GGMLType.IQ4_XS: (dequantize_iq4_xs, matvec_iq4_xs),
}
MATMUL = {GGMLType.IQ4_NL: matmul_iq4_nl, GGMLType.IQ4_XS: matmul_iq4_xs}
