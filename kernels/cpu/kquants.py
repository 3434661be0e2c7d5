"""K-quants (256 weights per super-block): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Same entry points as legacy.py: `dequantize_<t>(raw, out, lanes)` and
`matvec_<t>(raw, xq, xd, xs, xm, out)` with x in llama.cpp's Q8_K form ("q8_k" parts,
common.quantize_q8_k: int8 values, one float32 scale per 256, sums per 16).
A super-block splits into groups of 16 weights (Q2_K, Q3_K, Q6_K) or 32 (Q4_K, Q5_K), each
with an integer scale (and min); matvec sums scale * dot product over a whole super-block in
integers, then multiplies once by the float scales.
Dequantize follows gguf.quants operation for operation (no fast-math): bit-exact.

Where weight w (0..255) of a super-block lives, per type (c, s, t, h, l as named below):
  Q2_K  w = 128c + 32s + l:  q = (qs[32c + l] >> 2s) & 3;  group w//16: sc & 15, min sc >> 4
        w = d * sc * q - dmin * min
  Q3_K  w = 128c + 32s + l:  q = ((qs[32c + l] >> 2s) & 3) - (hmask[l] bit (4c + s) ? 0 : 4)
        group g: 6-bit scale = lo nibble of scales[g % 8] (>> 4 for g >= 8)
        | 2 bits of scales[8 + g % 4] >> 2(g // 4), minus 32;   w = d * scale * q
  Q4_K  sub-block b = 2c + nib (32 weights): q = nibble nib of qs[32c + l]; 6-bit sc, min
        packed in scales[12] (see _scale_min);  w = d * sc * q - dmin * min
  Q5_K  as Q4_K, plus 5th bit (qh[l] >> b) & 1
  Q6_K  w = 128h + 32t + l:  q = (nibble t//2 of ql[64h + 32(t % 2) + l])
        | ((qh[32h + l] >> 2t) & 3) << 4, minus 32;  group w//16: int8 scale;  w = d * sc * q
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import (F32, FAST_IN_ORDER, I32, JIT, SERIAL, U, dot32_field, f16_to_f32,
                                        fma32, load_f16, njit, prange)
from edgellm.kernels.cpu.rowdot import (rowdot_q2_k, rowdot_q3_k, rowdot_q5_k, rowdot_q6_k, rowdotx2_q6_k,
                                        rowdotx4_q6_k, sbdot1,
                                        sbdot1_min, sbdot4, sbdot4_min, tile8_corr, tile8_min, unpack_q2_k,
                                        unpack_q3_k, unpack_q4_k, unpack_q5_k, unpack_q6_k)
from edgellm.kernels.cpu.rows8 import _P_D, _P_DMIN, _P_MN, _P_SC, Q4_K8_SB, il8_q4_k, il8x4_q4_k, rows8_q4_k

QK_K = 256
# Bytes per super-block, fields in memory order.
Q2_K_BYTES = 16 + 64 + 2 + 2  # scales[16] (sc | min << 4) | qs[64] | d | dmin
Q3_K_BYTES = 32 + 64 + 12 + 2  # hmask[32] | qs[64] | scales[12] | d
Q4_K_BYTES = 2 + 2 + 12 + 128  # d | dmin | scales[12] | qs[128]
Q5_K_BYTES = 2 + 2 + 12 + 32 + 128  # d | dmin | scales[12] | qh[32] | qs[128]
Q6_K_BYTES = 128 + 64 + 16 + 2  # ql[128] | qh[64] | scales: i8[16] | d


@njit(inline="always")
def _q3_scale(row, o, g):
    """6-bit scale of group g (0..15) of a Q3_K block whose scales[12] start at byte o, minus 32."""
    lo = (I32(row[o + (g & U(7))]) >> I32(4 * (g >> U(3)))) & I32(15)
    hi = (I32(row[o + U(8) + (g & U(3))]) >> I32(2 * (g >> U(2)))) & I32(3)
    return (lo | (hi << I32(4))) - I32(32)


@njit(inline="always")
def _scale_min(row, o, b):
    """(scale, min) of sub-block b (0..7) of a Q4_K/Q5_K block whose scales[12] start at byte o."""
    if b < U(4):
        return I32(row[o + b]) & I32(63), I32(row[o + b + U(4)]) & I32(63)
    sc = (I32(row[o + b + U(4)]) & I32(15)) | ((I32(row[o + b - U(4)]) >> I32(6)) << I32(4))
    mn = (I32(row[o + b + U(4)]) >> I32(4)) | ((I32(row[o + b]) >> I32(6)) << I32(4))
    return sc, mn


# --- dequantize ----------------------------------------------------------------------------
@njit(**JIT)
def dequantize_q2_k(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for i in range(U(out.shape[1] // QK_K)):
            o, w0 = i * U(Q2_K_BYTES), i * U(QK_K)
            d = f16_to_f32(row[o + U(80)], row[o + U(81)])
            dmin = f16_to_f32(row[o + U(82)], row[o + U(83)])
            for g in range(U(16)):
                c, s, l0 = g >> U(3), (g >> U(1)) & U(3), (g & U(1)) * U(16)
                sc = I32(row[o + g])
                dl = d * F32(sc & I32(15))
                ml = dmin * F32(sc >> I32(4))
                q0 = o + U(16) + U(32) * c + l0
                for j in range(lanes):
                    q = (I32(row[q0 + j]) >> I32(2 * s)) & I32(3)
                    dst[w0 + U(16) * g + j] = dl * F32(q) - ml


@njit(**JIT)
def dequantize_q3_k(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for i in range(U(out.shape[1] // QK_K)):
            o, w0 = i * U(Q3_K_BYTES), i * U(QK_K)
            d = f16_to_f32(row[o + U(108)], row[o + U(109)])
            for g in range(U(16)):
                c, s, l0 = g >> U(3), (g >> U(1)) & U(3), (g & U(1)) * U(16)
                dl = d * F32(_q3_scale(row, o + U(96), g))
                bit = I32(4 * c + s)
                q0 = o + U(32) + U(32) * c + l0
                for j in range(lanes):
                    low = (I32(row[q0 + j]) >> I32(2 * s)) & I32(3)
                    high = (I32(row[o + l0 + j]) >> bit) & I32(1)
                    dst[w0 + U(16) * g + j] = dl * F32(low - ((high ^ I32(1)) << I32(2)))


@njit(**JIT)
def dequantize_q4_k(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for i in range(U(out.shape[1] // QK_K)):
            o, w0 = i * U(Q4_K_BYTES), i * U(QK_K)
            d = f16_to_f32(row[o], row[o + U(1)])
            dmin = f16_to_f32(row[o + U(2)], row[o + U(3)])
            for b in range(U(8)):
                sc, mn = _scale_min(row, o + U(4), b)
                dl = d * F32(sc)
                ml = dmin * F32(mn)
                q0 = o + U(16) + U(32) * (b >> U(1))
                shift = I32(4 * (b & U(1)))
                for j in range(lanes + lanes):
                    q = (I32(row[q0 + j]) >> shift) & I32(15)
                    dst[w0 + U(32) * b + j] = dl * F32(q) - ml


@njit(**JIT)
def dequantize_q5_k(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for i in range(U(out.shape[1] // QK_K)):
            o, w0 = i * U(Q5_K_BYTES), i * U(QK_K)
            d = f16_to_f32(row[o], row[o + U(1)])
            dmin = f16_to_f32(row[o + U(2)], row[o + U(3)])
            for b in range(U(8)):
                sc, mn = _scale_min(row, o + U(4), b)
                dl = d * F32(sc)
                ml = dmin * F32(mn)
                q0 = o + U(48) + U(32) * (b >> U(1))
                shift = I32(4 * (b & U(1)))
                for j in range(lanes + lanes):
                    q = ((I32(row[q0 + j]) >> shift) & I32(15)) \
                        | (((I32(row[o + U(16) + j]) >> I32(b)) & I32(1)) << I32(4))
                    dst[w0 + U(32) * b + j] = dl * F32(q) - ml


@njit(**JIT)
def dequantize_q6_k(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for i in range(U(out.shape[1] // QK_K)):
            o, w0 = i * U(Q6_K_BYTES), i * U(QK_K)
            d = f16_to_f32(row[o + U(208)], row[o + U(209)])
            for g in range(U(16)):
                h, t, l0 = g >> U(3), (g >> U(1)) & U(3), (g & U(1)) * U(16)
                dl = d * F32(np.int8(row[o + U(192) + g]))
                ql0 = o + U(64) * h + U(32) * (t & U(1)) + l0
                qh0 = o + U(128) + U(32) * h + l0
                for j in range(lanes):
                    q = ((I32(row[ql0 + j]) >> I32(4 * (t >> U(1)))) & I32(15)) \
                        | (((I32(row[qh0 + j]) >> I32(2 * t)) & I32(3)) << I32(4))
                    dst[w0 + U(16) * g + j] = dl * F32(q - I32(32))


# --- matvec --------------------------------------------------------------------------------
# x comes as "q8_k" parts (common.quantize_q8_k): per super-block i one integer sum of
# scale * dot(q, xq) (groups of 16 or 32), and for the types with mins one integer sum of
# min * (sums of xq), then llama.cpp's float terms d_w * xd[i] * isum and dmin_w * xd[i] * msum
# (the min terms summed separately and subtracted at the end).
@njit(**JIT)
def matvec_q2_k(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    for r in prange(raw.shape[0]):
        out[r] = rowdot_q2_k(raw[r], U(0), xq, U(0), xd, xs, U(0), nb)


@njit(**JIT)
def matvec_q3_k(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    for r in prange(raw.shape[0]):
        out[r] = rowdot_q3_k(raw[r], U(0), xq, U(0), xd, U(0), nb)


@njit(fastmath=FAST_IN_ORDER, inline="always")
def _row_q4_k(row, xq, xd, xs, t, nb, per_pair):
    """Row `row` times token t's x, in the order of ggml's x86 kernels for Q4_K rows repacked 8
    at a time (what llama.cpp runs when the row count is a multiple of 8): integer sums of
    sc * q * x and of min * (x sums), then acc = fma(isum, d_w * d_x, acc) and acc_m likewise
    with dmin; result acc - acc_m. The one-token kernel (gemv) takes one fma per super-block,
    the four-token one (gemm, per_pair) one per pair of sub-blocks."""
    acc = F32(0.0)
    acc_m = F32(0.0)
    for j in range(nb):
        i = t * nb + j
        o, x0, g0 = j * U(Q4_K_BYTES), i * U(QK_K), i * U(16)
        d = load_f16(row, o) * xd[i]
        dmin = load_f16(row, o + U(2)) * xd[i]
        isum = I32(0)
        msum = I32(0)
        for c in range(U(4)):  # 32 bytes: sub-block 2c (low nibbles), 2c + 1 (high)
            q0 = o + U(16) + U(32) * c
            sc0, m0 = _scale_min(row, o + U(4), c + c)
            sc1, m1 = _scale_min(row, o + U(4), c + c + U(1))
            isum += dot32_field(row, q0, I32(0), I32(15), xq, x0 + U(64) * c, sc0, sc0) \
                + dot32_field(row, q0, I32(4), I32(15), xq, x0 + U(64) * c + U(32), sc1, sc1)
            k = g0 + U(4) * c
            msum += m0 * (xs[k] + xs[k + U(1)]) + m1 * (xs[k + U(2)] + xs[k + U(3)])
            if per_pair:
                acc = fma32(F32(isum), d, acc)
                acc_m = fma32(F32(msum), dmin, acc_m)
                isum = I32(0)
                msum = I32(0)
        if not per_pair:
            acc = fma32(F32(isum), d, acc)
            acc_m = fma32(F32(msum), dmin, acc_m)
    return acc - acc_m


@njit(**JIT)
def matvec_q4_k(raw, xq, xd, xs, xm, out):
    """Eight rows at a time (rows8: the same sums, bit for bit), the last n_rows % 8 one by one."""
    nb, rb = U(xd.size), U(raw.shape[1])
    n8 = raw.shape[0] // 8
    for g in prange(n8):
        rows8_q4_k(raw, U(g) * U(8) * rb, rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))
    for r in range(n8 * 8, raw.shape[0]):
        out[r] = _row_q4_k(raw[r], xq, xd, xs, U(0), nb, False)


@njit(**SERIAL)
def sums32(xs):
    """int16 sums of x per 32 (Q8_K parts' sums per 16, added in pairs) for il8x4_q4_k."""
    out = np.empty(xs.size // 2, np.int16)
    for k in range(out.size):
        out[k] = xs[2 * k] + xs[2 * k + 1]
    return out


@njit(inline="always")
def _pack8(raw, r0, out, o0, nb):
    """Rows r0 .. r0 + 7 of a Q4_K matrix packed by eight (rows8.il8_q4_k's layout, Q4_K8_SB
    bytes per super-block) into out from byte o0 on."""
    for r in range(U(8)):
        row = raw[r0 + r]
        for j in range(nb):
            s = j * U(Q4_K_BYTES)
            o = o0 + j * U(Q4_K8_SB)
            for c in range(U(4)):
                for st in range(U(8)):
                    for q in range(U(4)):
                        out[o + U(256) * c + U(32) * st + U(4) * r + q] = row[s + U(16) + U(32) * c + U(4) * st + q]
            for k in range(U(2)):
                out[o + U(_P_D) + U(2) * r + k] = row[s + k]
                out[o + U(_P_DMIN) + U(2) * r + k] = row[s + U(2) + k]
            for b in range(U(8)):
                sc, mn = _scale_min(row, s + U(4), b)
                out[o + U(_P_SC) + U(8) * b + r] = sc
                out[o + U(_P_MN) + U(16) * (b >> U(1)) + U(2) * r + (b & U(1))] = mn


def pack8_shape(shape) -> tuple:
    """The packed array's shape for Q4_K rows of `shape` (n_rows, row bytes): 37 / 36 of the bytes."""
    return (shape[0], shape[1] // Q4_K_BYTES * (Q4_K8_SB // 8))


def pack8_q4_k(raw, out=None):
    """A Q4_K matrix (n_rows a multiple of 8) packed by eight rows for rows8.il8_q4_k /
    il8x4_q4_k: uint8 (n_rows, row_bytes * 37 / 36), group g (rows 8g .. 8g + 7) from row 8g's
    start on, so row offsets (r * row bytes, r a multiple of 8) mean what they mean for the
    rows (the unpacked 6-bit scales and mins: 32 bytes more per eight rows' super-block). Written
    into `out` when given (uint8 of that shape: CPUBackend's huge-page arena), else a new array."""
    shape = pack8_shape(raw.shape)
    if out is None:
        out = np.empty(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8:
        raise ValueError(f"packed Q4_K rows need uint8 {shape}, not {out.dtype} {out.shape}")
    _pack8_into(raw, out)
    return out


@njit(**JIT)
def _pack8_into(raw, out):
    nb = U(raw.shape[1] // Q4_K_BYTES)
    rb = U(out.shape[1])
    flat = out.reshape(-1)
    for g in prange(raw.shape[0] // 8):
        _pack8(raw, U(8 * g), flat, U(g) * U(8) * rb, nb)


@njit(**JIT)
def matvec_q4_k8(packed, xq, xd, xs, xm, out):
    """matvec_q4_k's results (bit for bit) from the packed rows (pack8_q4_k)."""
    nb, rb = U(xd.size), U(packed.shape[1])
    for g in prange(packed.shape[0] // 8):
        il8_q4_k(packed, U(g) * U(8) * rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))


@njit(inline="always")
def _gemm_groups(w, w0, n8, rb, xq, xd, xs32, nb, n_gemm, flat, ns, r0):
    """The first n_gemm tokens (a multiple of 4) over n8 packed groups from byte w0 on."""
    for t in range(0, n_gemm, 4):
        for i in range(n8):
            il8x4_q4_k(w, w0 + U(i) * U(8) * rb, xq, xd, xs32, U(t) * nb, nb, flat, U(t) * ns + U(r0 + 8 * i), ns)


@njit(**JIT)
def matmul_q4_k(raw, xq, xd, xs, xm, out):
    """The repacked Q4_K order for a batch (see _row_q4_k): four tokens at a time with a step per
    pair of sub-blocks, the rest of the tokens with one per super-block (rows8_q4_k), the last
    n_rows % 8 rows one by one. Chunks of 16 rows per thread, packed by eight once
    (pack8_q4_k's layout) for the groups of four tokens (rows8.il8x4_q4_k)."""
    n_tok, n_rows = out.shape
    nb, rb, ns = U(xd.size // n_tok), U(raw.shape[1]), U(n_rows)
    n_gemm = n_tok - n_tok % 4  # llama.cpp takes tokens four at a time, the rest one by one
    flat = out.reshape(-1)
    xs32 = sums32(xs)
    for c in prange((n_rows + 15) // 16):
        r0 = c * 16
        r1 = min(r0 + 16, n_rows)
        n8 = (r1 - r0) // 8
        r8 = r0 + n8 * 8
        if n_gemm > 0 and n8 > 0:
            prb = nb * U(Q4_K8_SB // 8)
            packed = np.empty(U(n8) * U(8) * prb, np.uint8)
            for i in range(n8):
                _pack8(raw, U(r0 + 8 * i), packed, U(i) * U(8) * prb, nb)
            _gemm_groups(packed, U(0), n8, prb, xq, xd, xs32, nb, n_gemm, flat, ns, r0)
        for t in range(n_gemm, n_tok):
            for r in range(r0, r8, 8):
                rows8_q4_k(raw, U(r) * rb, rb, xq, xd, xs, U(t) * nb, nb, flat, U(t) * ns + U(r))
        for t in range(n_tok):
            for r in range(r8, r1):
                out[t, r] = _row_q4_k(raw[r], xq, xd, xs, U(t), nb, t < n_gemm)


@njit(**JIT)
def matmul_q4_k8(packed, xq, xd, xs, xm, out):
    """matmul_q4_k's results (bit for bit) from the packed rows (pack8_q4_k): four tokens at a
    time over each group of eight rows, the rest of the tokens one by one (il8_q4_k)."""
    n_tok, n_rows = out.shape
    nb, rb, ns = U(xd.size // n_tok), U(packed.shape[1]), U(n_rows)
    n_gemm = n_tok - n_tok % 4
    flat = out.reshape(-1)
    pflat = packed.reshape(-1)
    xs32 = sums32(xs)
    for c in prange((n_rows + 15) // 16):
        r0 = c * 16
        n8 = (min(r0 + 16, n_rows) - r0) // 8
        _gemm_groups(pflat, U(r0) * rb, n8, rb, xq, xd, xs32, nb, n_gemm, flat, ns, r0)
        for t in range(n_gemm, n_tok):
            for i in range(n8):
                r = r0 + 8 * i
                il8_q4_k(pflat, U(r) * rb, xq, xd, xs, U(t) * nb, nb, flat, U(t) * ns + U(r))


@njit(**JIT)
def matvec_q5_k(raw, xq, xd, xs, xm, out):
    """Rows by 16 per parallel iteration, as matvec_q6_k."""
    nb = U(xd.size)
    n = raw.shape[0]
    for c in prange((n + 15) // 16):
        for r in range(c * 16, min(c * 16 + 16, n)):
            out[r] = rowdot_q5_k(raw[r], U(0), xq, U(0), xd, xs, U(0), nb)


@njit(**JIT)
def matvec_q6_k(raw, xq, xd, xs, xm, out):
    """Rows by 16 per parallel iteration (one row an iteration read a large head slower from
    memory)."""
    nb = U(xd.size)
    n = raw.shape[0]
    for c in prange((n + 15) // 16):
        for r in range(c * 16, min(c * 16 + 16, n)):
            out[r] = rowdot_q6_k(raw[r], U(0), xq, U(0), xd, xs, U(0), nb)


# --- batches of TILED_MIN or more tokens: llama.cpp's tiled product -------------------------
# For a batch of 8+ tokens llama.cpp multiplies K-quant weights (Q4_K only when not repacked)
# with its tiled kernel, whose float order is its own: per super-block the exact integer sums
# s1 = sum sc * q * x (q the signed code) and, with mins, s2 = sum min * (x sums); then
# res = d_w * f32(s1), res = fma(-dmin_w, f32(s2), res), acc = fma(res, d_x, acc) (AVX2/FMA).
# `_sb_<t>` returns (s1, s2) for one super-block: integers, so any order gives the same value.
TILED_MIN = 8


@njit(inline="always")
def _unpack_sb(kind, row, o, wq, sc, cm, k, scg):
    """Super-block k of a row tile, from the Q<kind>_K block at byte o of row, as unsigned codes
    wq[256 k + i] (code = q + offset, 0..63: rowdot.unpack_codes), the scale of each pair of
    weights sc[128 k + p] and, per group g of 16, cm[32 k + g] = -offset * scale and
    cm[32 k + 16 + g] = min, so that for a token's x: s1 = sum sc * code * x + sum corr * xs and
    s2 = sum min * xs (xs: x's sums per 16; see rowdot.sbdot_tile). scg: scratch for the 16
    group scales."""
    w0 = U(256) * k
    g0 = U(32) * k
    if kind == 2:
        unpack_q2_k(row, o, wq, w0)
    elif kind == 3:
        unpack_q3_k(row, o, wq, w0)
    elif kind == 4:
        unpack_q4_k(row, o, wq, w0)
    elif kind == 5:
        unpack_q5_k(row, o, wq, w0)
    else:
        unpack_q6_k(row, o, wq, w0)
    if kind == 2:
        for g in range(U(16)):
            scg[g] = I32(row[o + g]) & I32(15)
            cm[g0 + g] = 0
            cm[g0 + U(16) + g] = I32(row[o + g]) >> I32(4)
    elif kind == 3:  # q = low 2 bits + 4 * hmask bit - 4
        for g in range(U(16)):
            scg[g] = _q3_scale(row, o + U(96), g)
            cm[g0 + g] = I32(-4) * scg[g]
            cm[g0 + U(16) + g] = 0
    elif kind == 6:  # q = 6-bit code - 32
        for g in range(U(16)):
            scg[g] = I32(np.int8(row[o + U(192) + g]))
            cm[g0 + g] = I32(-32) * scg[g]
            cm[g0 + U(16) + g] = 0
    else:  # Q4_K, Q5_K: sub-blocks of 32 with a scale and a min
        for b in range(U(8)):
            sc_b, mn_b = _scale_min(row, o + U(4), b)
            for g in range(U(2) * b, U(2) * b + U(2)):
                scg[g] = sc_b
                cm[g0 + g] = 0
                cm[g0 + U(16) + g] = mn_b
    for g in range(U(16)):
        v = np.int16(scg[g])
        for q in range(U(8)):
            sc[U(128) * k + U(8) * g + q] = v


# by kind (2..6): bytes per super-block, byte offset of d, of dmin (-1: no mins)
_SB_LAYOUT = ((0, 0, 0), (0, 0, 0), (Q2_K_BYTES, 80, 82), (Q3_K_BYTES, 108, -1), (Q4_K_BYTES, 0, 2),
              (Q5_K_BYTES, 0, 2), (Q6_K_BYTES, 208, -1))


@njit(inline="always")
def _tiled_step(s1, s2, dw, dm, dx, has_min, acc):
    """llama.cpp's tiled float steps for one super-block."""
    res = dw * F32(s1)
    if has_min:
        res = fma32(-dm, F32(s2), res)
    return fma32(res, dx, acc)


TILED_ROWS = 8  # rows unpacked together (their codes and pair scales, 4 KiB per 1024 columns)


@njit(inline="always")
def _unpack_rows(kind, raw, r0, nr, nb):
    """Rows r0 .. r0 + nr of a Q<kind>_K matrix unpacked (_unpack_sb, super-block k = i * nb + j)
    with their float32 d and dmin (0 without mins): (codes, pair scales, corrections and mins, d, dmin)."""
    size, od, om = _SB_LAYOUT[kind]
    n_sb = U(nr) * nb
    wq = np.empty(n_sb * U(256), np.uint8)
    sc = np.empty(n_sb * U(128), np.int16)
    cm = np.empty(n_sb * U(32), np.int16)
    dw = np.empty(n_sb, F32)
    dm = np.zeros(n_sb, F32)
    scg = np.empty(16, I32)
    for i in range(nr):
        row = raw[r0 + i]
        for j in range(nb):
            k = U(i) * nb + j
            o = j * U(size)
            _unpack_sb(kind, row, o, wq, sc, cm, k, scg)
            dw[k] = load_f16(row, o + U(od))
            if om >= 0:
                dm[k] = load_f16(row, o + U(om))
    return wq, sc, cm, dw, dm


@njit(**SERIAL)
def _transpose8(xd, xs, n8, nb):
    """The scales and group sums of tokens 0 .. n8 - 1 (n8 a multiple of 8) by groups of eight
    tokens (see rowdot.tile8_row): xdT[8 (G nb + j) + t], xsT[16 (8 (G nb + j) + p) + 2 t + h]
    = group 2p + h (int16: |sums| < 2^15)."""
    xdT = np.empty(n8 * nb, F32)
    xsT = np.empty(n8 * nb * 16, np.int16)
    for G in range(n8 // 8):
        for t in range(8):
            tok = 8 * G + t
            for j in range(nb):
                b = (G * nb + j) * 8
                xdT[b + t] = xd[tok * nb + j]
                for p in range(8):
                    for h in range(2):
                        xsT[16 * (b + p) + 2 * t + h] = xs[(tok * nb + j) * 16 + 2 * p + h]
    return xdT, xsT


@njit(**JIT)
def matmul_tiled(kind, raw, xq, xd, xs, out):
    """out (n_tok, n_rows) for a Q<kind>_K matrix, every (row, token) in the tiled order. A chunk
    of rows is unpacked once (codes, pair scales, corrections) and the tokens pass over it eight
    at a time (rowdot.tile8_row: the eight tokens as vector lanes), the rest four and one at a time."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    has_min = _SB_LAYOUT[kind][2] >= 0
    n8 = n_tok - n_tok % 8
    n4 = n_tok - n_tok % 4
    xstride = nb * U(QK_K)
    gstride = nb * U(16)
    xdT, xsT = _transpose8(xd, xs, n8, nb)
    for c in prange((n_rows + TILED_ROWS - 1) // TILED_ROWS):
        r0 = c * TILED_ROWS
        nr = min(TILED_ROWS, n_rows - r0)
        wq, sc, cm, dw, dm = _unpack_rows(kind, raw, r0, nr, nb)
        for t in range(0, n8, 8):
            for i in range(nr):
                k0 = U(i) * nb
                g_off = U(t) * nb
                if has_min:
                    a = tile8_min(wq, sc, cm, k0, dw, dm, xq, U(t) * xstride, xstride, xsT, xdT, g_off, nb)
                else:
                    a = tile8_corr(wq, sc, cm, k0, dw, dm, xq, U(t) * xstride, xstride, xsT, xdT, g_off, nb)
                for u in range(8):
                    out[t + u, r0 + i] = a[u]
        for t in range(n8, n4, 4):
            for i in range(nr):
                a0 = a1 = a2 = a3 = F32(0.0)
                for j in range(nb):
                    k = U(i) * nb + j
                    ts = U(t) * nb + j
                    if has_min:
                        p0, p1, p2, p3, m0, m1, m2, m3 = sbdot4_min(wq, k * U(256), sc, k * U(128), cm, k * U(32),
                                                                    xq, ts * U(QK_K), xstride, xs, ts * U(16), gstride)
                    else:
                        p0, p1, p2, p3 = sbdot4(wq, k * U(256), sc, k * U(128), cm, k * U(32),
                                                xq, ts * U(QK_K), xstride, xs, ts * U(16), gstride)
                        m0 = m1 = m2 = m3 = I32(0)
                    a0 = _tiled_step(p0, m0, dw[k], dm[k], xd[ts], has_min, a0)
                    a1 = _tiled_step(p1, m1, dw[k], dm[k], xd[ts + nb], has_min, a1)
                    a2 = _tiled_step(p2, m2, dw[k], dm[k], xd[ts + U(2) * nb], has_min, a2)
                    a3 = _tiled_step(p3, m3, dw[k], dm[k], xd[ts + U(3) * nb], has_min, a3)
                out[t, r0 + i] = a0
                out[t + 1, r0 + i] = a1
                out[t + 2, r0 + i] = a2
                out[t + 3, r0 + i] = a3
        for t in range(n4, n_tok):
            for i in range(nr):
                a = F32(0.0)
                for j in range(nb):
                    k = U(i) * nb + j
                    ts = U(t) * nb + j
                    if has_min:
                        p, m = sbdot1_min(wq, k * U(256), sc, k * U(128), cm, k * U(32),
                                          xq, ts * U(QK_K), xstride, xs, ts * U(16), gstride)
                    else:
                        p = sbdot1(wq, k * U(256), sc, k * U(128), cm, k * U(32),
                                   xq, ts * U(QK_K), xstride, xs, ts * U(16), gstride)
                        m = I32(0)
                    a = _tiled_step(p, m, dw[k], dm[k], xd[ts], has_min, a)
                out[t, r0 + i] = a


KERNELS = {
    GGMLType.Q2_K: (dequantize_q2_k, matvec_q2_k),
    GGMLType.Q3_K: (dequantize_q3_k, matvec_q3_k),
    GGMLType.Q4_K: (dequantize_q4_k, matvec_q4_k),
    GGMLType.Q5_K: (dequantize_q5_k, matvec_q5_k),
    GGMLType.Q6_K: (dequantize_q6_k, matvec_q6_k),
}


def _batch_product(kind, ggml_type, below=None):
    """The prompt product of a Q<kind>_K matrix: the tiled order from TILED_MIN tokens on (Q4_K:
    only when llama.cpp does not repack it, i.e. the row count is not a multiple of 8); smaller
    batches take llama.cpp's one-token order: `below(raw, xq, xd, xs, xm, out)` for the whole
    batch if given, else the type's matvec kernel token by token."""
    matvec = KERNELS[ggml_type][1]

    def matmul(raw, xq, xd, xs, xm, out):
        n_tok = out.shape[0]
        if n_tok >= TILED_MIN and (kind != 4 or raw.shape[0] % 8):
            matmul_tiled(kind, raw, xq, xd, xs, out)
        elif below is not None:
            below(raw, xq, xd, xs, xm, out)
        else:
            nb = xd.size // n_tok
            for t in range(n_tok):
                matvec(raw, xq[t * nb * QK_K:(t + 1) * nb * QK_K], xd[t * nb:(t + 1) * nb],
                       xs[t * nb * 16:(t + 1) * nb * 16], xm, out[t])
    return matmul


# --- batches under TILED_MIN tokens: the one-token order, each row read once for all tokens --------
# (token by token, each token would read the whole matrix again: a verification step's head)
@njit(**JIT)
def rows_q2_k(raw, xq, xd, xs, xm, out):
    n_tok, n = out.shape[0], raw.shape[0]
    nb = U(xd.size // n_tok)
    for c in prange((n + 15) // 16):
        for t in range(n_tok):
            for r in range(c * 16, min(c * 16 + 16, n)):
                out[t, r] = rowdot_q2_k(raw[r], U(0), xq, U(t) * nb * U(QK_K), xd, xs, U(t) * nb, nb)


@njit(**JIT)
def rows_q3_k(raw, xq, xd, xs, xm, out):
    n_tok, n = out.shape[0], raw.shape[0]
    nb = U(xd.size // n_tok)
    for c in prange((n + 15) // 16):
        for t in range(n_tok):
            for r in range(c * 16, min(c * 16 + 16, n)):
                out[t, r] = rowdot_q3_k(raw[r], U(0), xq, U(t) * nb * U(QK_K), xd, U(t) * nb, nb)


@njit(**JIT)
def rows_q5_k(raw, xq, xd, xs, xm, out):
    n_tok, n = out.shape[0], raw.shape[0]
    nb = U(xd.size // n_tok)
    for c in prange((n + 15) // 16):
        for t in range(n_tok):
            for r in range(c * 16, min(c * 16 + 16, n)):
                out[t, r] = rowdot_q5_k(raw[r], U(0), xq, U(t) * nb * U(QK_K), xd, xs, U(t) * nb, nb)


@njit(**JIT)
def rows_q6_k(raw, xq, xd, xs, xm, out):
    """Each row's codes unpacked once for up to four tokens (rowdot.rowdotx4_q6_k: the one-token
    kernel's bits)."""
    n_tok, n = out.shape[0], raw.shape[0]
    nb, ns = U(xd.size // n_tok), U(n)
    flat = out.reshape(-1)
    for c in prange((n + 15) // 16):
        for r in range(c * 16, min(c * 16 + 16, n)):
            q6_k_tokens(raw[r], xq, xd, xs, nb, n_tok, flat, U(r), ns)


@njit(inline="always")
def q6_k_tokens(w, xq, xd, xs, nb, n_tok, out, out_off, out_stride):
    """Row w (at byte 0) times n_tok tokens' Q8_K activations (token t's blocks at t nb) into
    out[out_off + t out_stride]: four, then two, then one at a time."""
    t = 0
    while t < n_tok:
        m = n_tok - t
        if m >= 4:
            rowdotx4_q6_k(w, U(0), xq, U(t) * nb * U(QK_K), xd, xs, U(t) * nb, nb, out, out_off + U(t) * out_stride,
                          out_stride)
            t += 4
        elif m >= 2:
            rowdotx2_q6_k(w, U(0), xq, U(t) * nb * U(QK_K), xd, xs, U(t) * nb, nb, out, out_off + U(t) * out_stride,
                          out_stride)
            t += 2
        else:
            out[out_off + U(t) * out_stride] = rowdot_q6_k(w, U(0), xq, U(t) * nb * U(QK_K), xd, xs, U(t) * nb, nb)
            t += 1


MATMUL = {GGMLType.Q2_K: _batch_product(2, GGMLType.Q2_K, rows_q2_k),
          GGMLType.Q3_K: _batch_product(3, GGMLType.Q3_K, rows_q3_k),
          GGMLType.Q4_K: _batch_product(4, GGMLType.Q4_K, matmul_q4_k),
          GGMLType.Q5_K: _batch_product(5, GGMLType.Q5_K, rows_q5_k),
          GGMLType.Q6_K: _batch_product(6, GGMLType.Q6_K, rows_q6_k)}
