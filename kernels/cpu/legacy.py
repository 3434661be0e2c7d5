"""Legacy block types (32 weights per block): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Each type has `dequantize_<t>(raw, out, lanes)` and `matvec_<t>(raw, xq, xd, xs, xm, out)`:
raw uint8 (n_rows, n_blocks * type_size), out float32 (n_rows, n_cols) or (n_rows,);
(xq, xd, xs, xm) is x in the "q8_32" format (common.quantize_q8_32); lanes = common.LANES (16).
Block j of a row starts at byte j * type_size; its weights are columns 32j .. 32j+31.
Nibble order (Q4/Q5): byte i of qs holds weight i (low nibble) and weight i + 16 (high nibble).

Matvec per block b, with q the stored unsigned integer and x in llama.cpp's Q8_0 / Q8_1 form
(xq, fp16 scale xd, S = sum(xq), Q8_1's fp16 xm = fp16(d * S)):
    Q4_0: d * xd * (sum(q * xq) - 8 * S)          Q4_1: d * xd * sum(q * xq) + m * xm
    Q5_0: d * xd * (sum(q * xq) - 16 * S)         Q5_1: as Q4_1, q has 5 bits
    Q8_0: d * xd * sum(q * xq), q signed
Dequantize follows gguf.quants operation for operation (no fast-math), so it is bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.ir.legacy import rowdot_q4_1, rowdot_q5_0, rowdot_q8_0
from edgellm.kernels.cpu.ir.tiles import (Q8_0_GROUP, TILE, rowdot1_q5_1, rowdot2xn_q8_0, rowdot4_q4_1u, rowdot4_q5_1,
                                          rowdot4_q8_0, rowdot8_q5_0)
from edgellm.kernels.cpu.common import F32, FAST_IN_ORDER, I32, JIT, U, f16_to_f32, load_f16, njit, prange
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.legacy import dot32_q4
from edgellm.kernels.cpu.ir.packed import IL_Q4_0, il8x4_q4_0
from edgellm.kernels.cpu.ir.rows8 import rows8_q4_0, rows8_q5_0, rows8_q8_0

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
# x comes as "q8_32" parts (common.quantize_q8_32): per block b the integer dot product s of the
# weights' integers with xq, then llama.cpp's float terms: d_w * xd[b] * s for Q4_0 / Q5_0 / Q8_0
# (q - 8 and q - 16 folded in as s - 8 * xs[b]), and for Q4_1 / Q5_1 also m_w * xm[b] (the fp16
# s of Q8_1), summed separately and added at the end.
@njit(fastmath=FAST_IN_ORDER, inline="always")
def row_q4_0(row, xq, xd, xs, t, nb):
    """Row times token t's x in the order of ggml's x86 kernels for Q4_0 rows repacked 8 at a
    time (llama.cpp's layout when the row count is a multiple of 8): per block the exact integer
    sum of (q - 8) x, then acc = fma(isum, d_w * d_x, acc)."""
    acc = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(Q4_0_BYTES)
        s = dot32_q4(row, o + U(2), xq, b * U(32)) - I32(8) * xs[b]
        acc = fma32(F32(s), load_f16(row, o) * xd[b], acc)
    return acc


@njit(**JIT)
def matvec_q4_0(raw, xq, xd, xs, xm, out):
    """Eight rows at a time (rows8: the same sums, bit for bit), the last n_rows % 8 one by one."""
    nb, rb = U(xd.size), U(raw.shape[1])
    n8 = raw.shape[0] // 8
    for g in prange(n8):
        rows8_q4_0(raw, U(g) * U(8) * rb, rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))
    for r in range(n8 * 8, raw.shape[0]):
        out[r] = row_q4_0(raw[r], xq, xd, xs, U(0), nb)


@njit(**JIT)
def matvec_q4_1(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    for r in prange(raw.shape[0]):
        out[r] = rowdot_q4_1(raw[r], U(0), xq, U(0), xd, xm, U(0), nb)


@njit(**JIT)
def matvec_q5_0(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    rb = U(raw.shape[1])
    n8 = raw.shape[0] // 8
    for g in prange(n8):  # eight rows at a time, as matvec_q8_0
        rows8_q5_0(raw, U(g) * U(8) * rb, rb, xq, U(0), xd, U(0), nb, out, U(g) * U(8))
    for r in range(n8 * 8, raw.shape[0]):
        out[r] = rowdot_q5_0(raw[r], U(0), xq, U(0), xd, U(0), nb)


@njit(**JIT)
def matvec_q5_1(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    for r in prange(raw.shape[0]):
        out[r] = rowdot1_q5_1(raw[r], U(0), xq, U(0), U(0), xd, xm, U(0), nb)


@njit(**JIT)
def matvec_q8_0(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    rb = U(raw.shape[1])
    n8 = raw.shape[0] // 8
    for g in prange(n8):  # eight rows at a time (rows8: the one-row kernel's sums, eight chains at once)
        rows8_q8_0(raw, U(g) * U(8) * rb, rb, xq, U(0), xd, U(0), nb, out, U(g) * U(8))
    for r in range(n8 * 8, raw.shape[0]):
        out[r] = rowdot_q8_0(raw[r], U(0), xq, U(0), xd, U(0), nb)


# --- matmul (a batch of tokens) -------------------------------------------------------------
# x (n_tok, n_cols) as "q8_32" parts of the flattened rows (token t's blocks at t * nb ...).
# Each output is the same row dot product as matvec's (llama.cpp's prompt products for these
# types call the same vec_dot per (row, token) pair); rows go in chunks of ROW_CHUNK so a chunk's
# weights stay in L1 while every token passes over them.
ROW_CHUNK = 16


@njit(inline="always")
def interleave_blocks(v, n_full, group, nb):
    """Per-token block values (token t's block i at t * nb + i) of the first n_full tokens (a
    multiple of `group`) interleaved by groups of `group` tokens, as the rowdot tiles read them:
    token group * g + j's block i at group * (g * nb + i) + j."""
    out = np.empty(U(n_full) * nb, np.float32)
    ug = U(group)
    for t in range(n_full):
        g, j = U(t) // ug, U(t) % ug
        for i in range(nb):
            out[ug * (g * nb + i) + j] = v[U(t) * nb + i]
    return out


@njit(inline="always")
def unpack_q4_1_rows(raw, r0, r1, nb):
    """Rows r0..r1 of a Q4_1 matrix as "q4_1u" blocks of 40 bytes: d and m as float32 (exact
    conversions of the f16 fields), then the 32 codes a byte each (weights 0..15 from the low
    nibbles, 16..31 from the high)."""
    buf = np.empty(U(r1 - r0) * nb * U(40), np.uint8)
    f = buf.view(np.float32)
    for r in range(r0, r1):
        row = raw[r]
        for b in range(nb):
            o = b * U(20)
            ob = (U(r - r0) * nb + b) * U(40)
            f[ob // U(4)] = load_f16(row, o)
            f[ob // U(4) + U(1)] = load_f16(row, o + U(2))
            for j in range(16):
                q = row[o + U(4) + U(j)]
                buf[ob + U(8) + U(j)] = q & 15
                buf[ob + U(24) + U(j)] = q >> 4
    return buf


@njit(**JIT)
def matmul_q4_1(raw, xq, xd, xs, xm, out):
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    rb = U(raw.shape[1])
    n4 = n_tok - n_tok % TILE
    xdt, xmt = interleave_blocks(xd, n4, TILE, nb), interleave_blocks(xm, n4, TILE, nb)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(r0 + ROW_CHUNK, n_rows)
        w = unpack_q4_1_rows(raw, r0, r1, nb)  # once for all the token groups
        for t in range(0, n4, TILE):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = rowdot4_q4_1u(
                    w, U(r - r0) * nb * U(40), xq, ut * nb * U(32), nb * U(32), xdt, xmt, ut * nb, nb)
        for t in range(n4, n_tok):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r] = rowdot_q4_1(raw, U(r) * rb, xq, ut * nb * U(32), xd, xm, ut * nb, nb)


@njit(cache=True, nogil=True)  # not inlined into the parallel caller: its slice copies became parallel loops
def q8_0_group_inputs(xq, n_g, nb, g):
    """rowdot2xn_q8_0's activations for the first n_g tokens (a multiple of g, its tokens): per
    group of g tokens and block the g tokens' 32 codes side by side, and per token and block the
    eight lane corrections -128 x (sum of each four codes)."""
    xg = np.empty(U(n_g) * nb * U(32), np.int8)
    corr = np.empty(U(n_g) * nb * U(8), np.int32)
    ug = U(g)
    for t in range(n_g):
        grp, j = U(t) // ug, U(t) % ug
        for i in range(nb):
            src = (U(t) * nb + i) * U(32)
            blk = grp * nb + i
            dst = (blk * ug + j) * U(32)
            xg[dst:dst + U(32)] = xq[src:src + U(32)]
            for lane in range(8):
                q = src + U(4 * lane)
                corr[(blk * ug + j) * U(8) + U(lane)] = -128 * (I32(xq[q]) + I32(xq[q + U(1)]) + I32(xq[q + U(2)])
                                                                + I32(xq[q + U(3)]))
    return xg, corr


@njit(**JIT)
def matmul_q8_0(raw, xq, xd, xs, xm, out):
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    rb = U(raw.shape[1])
    G = Q8_0_GROUP  # tokens a two-row tile (0: none), then four-token tiles, then one token
    ng = n_tok - n_tok % G if G else 0
    n4 = n_tok - (n_tok - ng) % TILE
    xdg = interleave_blocks(xd, ng, max(G, 1), nb)
    xg, corr = q8_0_group_inputs(xq, ng, nb, max(G, 1))
    xdt = interleave_blocks(xd[U(ng) * nb:], n4 - ng, TILE, nb)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(r0 + ROW_CHUNK, n_rows)
        for t in range(0, ng, max(G, 1)):
            ut = U(t)
            for r in range(r0, r1, 2):  # an odd row left goes as both rows of the pair
                res = rowdot2xn_q8_0(raw, U(r) * rb, U(min(r + 1, r1 - 1)) * rb, xg, ut * nb * U(32), corr, xdg,
                                     ut * nb, nb)
                for k in range(G):
                    out[t + k, r] = res[k]
                    if r + 1 < r1:
                        out[t + k, r + 1] = res[G + k]
        for t in range(ng, n4, TILE):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = rowdot4_q8_0(
                    raw, U(r) * rb, xq, ut * nb * U(32), nb * U(32), xdt, xdt, U(t - ng) * nb, nb)
        for t in range(n4, n_tok):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r] = rowdot_q8_0(raw, U(r) * rb, xq, ut * nb * U(32), xd, ut * nb, nb)


@njit(**JIT)
def matmul_q5_0(raw, xq, xd, xs, xm, out):
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    rb = U(raw.shape[1])
    n8 = n_tok - n_tok % 8
    xdt = interleave_blocks(xd, n8, 8, nb)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(r0 + ROW_CHUNK, n_rows)
        for t in range(0, n8, 8):
            ut = U(t)
            for r in range(r0, r1):
                (out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r], out[t + 4, r], out[t + 5, r], out[t + 6, r],
                 out[t + 7, r]) = rowdot8_q5_0(raw, U(r) * rb, xq, ut * nb * U(32), nb * U(32), xdt, xdt, ut * nb, nb)
        for t in range(n8, n_tok):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r] = rowdot_q5_0(raw, U(r) * rb, xq, ut * nb * U(32), xd, ut * nb, nb)


@njit(**JIT)
def matmul_q5_1(raw, xq, xd, xs, xm, out):
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    rb = U(raw.shape[1])
    n4 = n_tok - n_tok % TILE
    xdt, xmt = interleave_blocks(xd, n4, TILE, nb), interleave_blocks(xm, n4, TILE, nb)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(r0 + ROW_CHUNK, n_rows)
        for t in range(0, n4, TILE):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = rowdot4_q5_1(
                    raw, U(r) * rb, xq, ut * nb * U(32), nb * U(32), xdt, xmt, ut * nb, nb)
        for t in range(n4, n_tok):
            ut = U(t)
            for r in range(r0, r1):
                out[t, r] = rowdot1_q5_1(raw, U(r) * rb, xq, ut * nb * U(32), U(0), xd, xm, ut * nb, nb)


@njit(inline="always")
def interleave8_q4_0(raw, r0, n_groups, nb):
    """Rows r0 .. r0 + 8 n_groups of a Q4_0 matrix interleaved by eight for ir.packed.il8x4_q4_0:
    block j of group i is g = i nb + j; codes[256 g + 32 s + 4 r + q] = code 4s + q (weight
    order: the 16 low nibbles, then the 16 high) of row r's block, dws[8 g + r] its d."""
    n_blk = U(n_groups) * nb
    codes = np.empty(n_blk * U(IL_Q4_0), np.uint8)
    dws = np.empty(n_blk * U(8), F32)
    for i in range(n_groups):
        for r in range(U(8)):
            row = raw[r0 + U(8) * U(i) + r]
            for j in range(nb):
                g = U(i) * nb + j
                o = j * U(18)
                dws[U(8) * g + r] = load_f16(row, o)
                for w in range(U(16)):
                    byte = row[o + U(2) + w]
                    codes[U(IL_Q4_0) * g + U(32) * (w >> U(2)) + U(4) * r + (w & U(3))] = byte & U(15)
                    w1 = w + U(16)
                    codes[U(IL_Q4_0) * g + U(32) * (w1 >> U(2)) + U(4) * r + (w1 & U(3))] = byte >> U(4)
    return codes, dws


IL_MIN_TOKENS = 8


@njit(**JIT)
def matmul_q4_0(raw, xq, xd, xs, xm, out):
    """Tiles of eight rows x four tokens (ir.packed.il8x4_q4_0, each chunk of rows interleaved once),
    the rest of the rows and tokens one by one: every output the one-token row kernel's, bit
    for bit."""
    n_tok, n_rows = out.shape
    nb, rb, ns = U(xd.size // n_tok), U(raw.shape[1]), U(n_rows)
    # interleaving a chunk costs about a pass of the eight-row kernel over four tokens: below
    # IL_MIN_TOKENS every token takes rows8_q4_0 (the same bits)
    n4 = n_tok - n_tok % 4 if n_tok >= IL_MIN_TOKENS else 0
    flat = out.reshape(-1)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        r0 = c * ROW_CHUNK
        r1 = min(r0 + ROW_CHUNK, n_rows)
        n8 = (r1 - r0) // 8
        r8 = r0 + n8 * 8
        if n4 > 0 and n8 > 0:
            codes, dws = interleave8_q4_0(raw, U(r0), n8, nb)
            for t in range(0, n4, 4):
                for i in range(n8):
                    il8x4_q4_0(codes, dws, U(i) * nb, xq, xd, xs, U(t) * nb, nb, flat, U(t) * ns + U(r0 + 8 * i), ns)
        for t in range(n4, n_tok):
            for r in range(r0, r8, 8):
                rows8_q4_0(raw, U(r) * rb, rb, xq, xd, xs, U(t) * nb, nb, flat, U(t) * ns + U(r))
        for t in range(n_tok):
            for r in range(r8, r1):
                out[t, r] = row_q4_0(raw[r], xq, xd, xs, U(t), nb)


MATMUL = {GGMLType.Q4_0: matmul_q4_0, GGMLType.Q4_1: matmul_q4_1, GGMLType.Q5_0: matmul_q5_0,
          GGMLType.Q5_1: matmul_q5_1, GGMLType.Q8_0: matmul_q8_0}


KERNELS = {
    GGMLType.Q4_0: (dequantize_q4_0, matvec_q4_0),
    GGMLType.Q4_1: (dequantize_q4_1, matvec_q4_1),
    GGMLType.Q5_0: (dequantize_q5_0, matvec_q5_0),
    GGMLType.Q5_1: (dequantize_q5_1, matvec_q5_1),
    GGMLType.Q8_0: (dequantize_q8_0, matvec_q8_0),
}
