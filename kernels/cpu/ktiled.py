"""K-quant prompt products of TILED_MIN or more tokens in llama.cpp's tiled order (matmul_tiled):
a chunk of rows unpacked once to unsigned codes, then the tokens passed over it by the IR tiles."""
from __future__ import annotations

import numpy as np

from edgellm.kernels.cpu.common import F32, I32, JIT, SERIAL, U, load_f16, njit, prange
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.tiles import sbdot1, sbdot1_min, sbdot4, sbdot4_min, tile8_corr, tile8_min
from edgellm.kernels.cpu.ir.unpack import unpack_q2_k, unpack_q3_k, unpack_q4_k, unpack_q5_k, unpack_q6_k
from edgellm.kernels.cpu.kblocks import (Q2_K_BYTES, Q3_K_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K, q3_scale,
                                         scale_min)


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
    wq[256 k + i] (code = q + offset, 0..63: ir.unpack), the scale of each pair of
    weights sc[128 k + p] and, per group g of 16, cm[32 k + g] = -offset * scale and
    cm[32 k + 16 + g] = min, so that for a token's x: s1 = sum sc * code * x + sum corr * xs and
    s2 = sum min * xs (xs: x's sums per 16; see ir.tiles.sbdot_tile). scg: scratch for the 16
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
            scg[g] = q3_scale(row, o + U(96), g)
            cm[g0 + g] = I32(-4) * scg[g]
            cm[g0 + U(16) + g] = 0
    elif kind == 6:  # q = 6-bit code - 32
        for g in range(U(16)):
            scg[g] = I32(np.int8(row[o + U(192) + g]))
            cm[g0 + g] = I32(-32) * scg[g]
            cm[g0 + U(16) + g] = 0
    else:  # Q4_K, Q5_K: sub-blocks of 32 with a scale and a min
        for b in range(U(8)):
            sc_b, mn_b = scale_min(row, o + U(4), b)
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
    tokens (see ir.tiles.tile8_row): xdT[8 (G nb + j) + t], xsT[16 (8 (G nb + j) + p) + 2 t + h]
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
    at a time (ir.tiles.tile8_row: the eight tokens as vector lanes), the rest four and one at a time."""
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
