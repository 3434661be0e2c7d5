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
        packed in scales[12] (see scale_min);  w = d * sc * q - dmin * min
  Q5_K  as Q4_K, plus 5th bit (qh[l] >> b) & 1
  Q6_K  w = 128h + 32t + l:  q = (nibble t//2 of ql[64h + 32(t % 2) + l])
        | ((qh[32h + l] >> 2t) & 3) << 4, minus 32;  group w//16: int8 scale;  w = d * sc * q
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, FAST_IN_ORDER, I32, JIT, SERIAL, U, f16_to_f32, load_f16, njit, prange
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.legacy import dot32_field
from edgellm.kernels.cpu.ir.kquants import (rowdot_q2_k, rowdot_q3_k, rowdot_q5_k, rowdot_q6_k, rowdotx2_q6_k,
                                            rowdotx4_q6_k)
from edgellm.kernels.cpu.ir.packed import PACK_D, PACK_DMIN, PACK_MN, PACK_SC, Q4_K8_SB, il8_q4_k, il8x4_q4_k
from edgellm.kernels.cpu.ir.rows8 import rows8_q4_k
from edgellm.kernels.cpu.kblocks import (Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K, q3_scale,
                                         scale_min)
from edgellm.kernels.cpu.ktiled import TILED_MIN, matmul_tiled

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
                dl = d * F32(q3_scale(row, o + U(96), g))
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
                sc, mn = scale_min(row, o + U(4), b)
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
                sc, mn = scale_min(row, o + U(4), b)
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
def row_q4_k(row, xq, xd, xs, t, nb, per_pair):
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
            sc0, m0 = scale_min(row, o + U(4), c + c)
            sc1, m1 = scale_min(row, o + U(4), c + c + U(1))
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
        out[r] = row_q4_k(raw[r], xq, xd, xs, U(0), nb, False)


@njit(**SERIAL)
def sums32(xs):
    """int16 sums of x per 32 (Q8_K parts' sums per 16, added in pairs) for il8x4_q4_k."""
    out = np.empty(xs.size // 2, np.int16)
    for k in range(out.size):
        out[k] = xs[2 * k] + xs[2 * k + 1]
    return out


@njit(inline="always")
def _pack8(raw, r0, out, o0, nb):
    """Rows r0 .. r0 + 7 of a Q4_K matrix packed by eight (ir.packed.il8_q4_k's layout, Q4_K8_SB
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
                out[o + U(PACK_D) + U(2) * r + k] = row[s + k]
                out[o + U(PACK_DMIN) + U(2) * r + k] = row[s + U(2) + k]
            for b in range(U(8)):
                sc, mn = scale_min(row, s + U(4), b)
                out[o + U(PACK_SC) + U(8) * b + r] = sc
                out[o + U(PACK_MN) + U(16) * (b >> U(1)) + U(2) * r + (b & U(1))] = mn


def pack8_shape(shape) -> tuple:
    """The packed array's shape for Q4_K rows of `shape` (n_rows, row bytes): 37 / 36 of the bytes."""
    return (shape[0], shape[1] // Q4_K_BYTES * (Q4_K8_SB // 8))


def pack8_q4_k(raw, out=None):
    """A Q4_K matrix (n_rows a multiple of 8) packed by eight rows for ir.packed.il8_q4_k /
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
    """The repacked Q4_K order for a batch (see row_q4_k): four tokens at a time with a step per
    pair of sub-blocks, the rest of the tokens with one per super-block (rows8_q4_k), the last
    n_rows % 8 rows one by one. Chunks of 16 rows per thread, packed by eight once
    (pack8_q4_k's layout) for the groups of four tokens (ir.packed.il8x4_q4_k)."""
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
                out[t, r] = row_q4_k(raw[r], xq, xd, xs, U(t), nb, t < n_gemm)


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
    """Each row's codes unpacked once for up to four tokens (ir.kquants.rowdotx4_q6_k: the one-token
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
