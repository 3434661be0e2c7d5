"""NumPy references of the kernels that sum in ggml's order (ir/, the Q4_K rows of
kquants.py, attention's dot products): slow, written from the description of ggml's x86 code,
and bit-for-bit what the kernels must return (tests/test_ggml_order.py).

Every function takes weight rows as raw uint8 (n_rows, row_bytes) and x already in its activation
format (the parts of `edgellm.kernels.cpu.quantize`), and returns float32 (n_rows,).
fma(a, b, c) is computed in float64 (the float32 product is exact there) and rounded once.
"""
from __future__ import annotations

import numpy as np

from edgellm import quants

F32 = np.float32


def fma(a, b, c) -> np.ndarray:
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64)).astype(F32)


def hsum8(acc: np.ndarray) -> np.ndarray:
    """ggml's hsum_float_8 over the last axis (8 lanes): ((4+0) + (6+2)) + ((5+1) + (7+3))."""
    a = acc.astype(F32)
    r = [(a[..., i + 4] + a[..., i]).astype(F32) for i in range(4)]
    return ((r[0] + r[2]).astype(F32) + (r[1] + r[3]).astype(F32)).astype(F32)


def _f16(raw: np.ndarray, off: int) -> np.ndarray:
    return np.ascontiguousarray(raw[:, off:off + 2]).view(np.float16)[:, 0].astype(F32)


def _quads(w: np.ndarray, y: np.ndarray) -> np.ndarray:
    """(rows, 8) int64: lane j = sum of w * y over bytes 4j .. 4j+3 of a 32-byte block."""
    return (w.astype(np.int64) * y.astype(np.int64)).reshape(*w.shape[:-1], 8, 4).sum(-1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(rows, 16) bytes -> (rows, 32): weights 0..15 from the low nibbles, 16..31 from the high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def rowdot_q4_1(raw, xq, xd, xm) -> np.ndarray:
    nb = xd.size
    acc = np.zeros((raw.shape[0], 8), F32)
    summs = np.zeros(raw.shape[0], F32)
    for b in range(nb):
        blk = raw[:, 20 * b:20 * b + 20]
        d0, m0 = _f16(blk, 0), _f16(blk, 2)
        summs = fma(m0, xm[b], summs)
        lanes = _quads(_nibbles(blk[:, 4:20]), xq[32 * b:32 * b + 32]).astype(F32)
        acc = fma((d0 * xd[b]).astype(F32)[:, None], lanes, acc)
    return (hsum8(acc) + summs).astype(F32)


def rowdot_q8_0(raw, xq, xd) -> np.ndarray:
    acc = np.zeros((raw.shape[0], 8), F32)
    for b in range(xd.size):
        blk = raw[:, 34 * b:34 * b + 34]
        lanes = _quads(blk[:, 2:34].view(np.int8), xq[32 * b:32 * b + 32]).astype(F32)
        acc = fma((_f16(blk, 0) * xd[b]).astype(F32)[:, None], lanes, acc)
    return hsum8(acc)


def rowdot_q5_0(raw, xq, xd) -> np.ndarray:
    acc = np.zeros((raw.shape[0], 8), F32)
    for b in range(xd.size):
        blk = raw[:, 22 * b:22 * b + 22]
        qh = np.ascontiguousarray(blk[:, 2:6]).view(np.uint32)[:, 0]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)
        q = _nibbles(blk[:, 6:22]).astype(np.int64) + 16 * high - 16
        lanes = _quads(q, xq[32 * b:32 * b + 32]).astype(F32)
        acc = fma((_f16(blk, 0) * xd[b]).astype(F32)[:, None], lanes, acc)
    return hsum8(acc)


def _q6_k_values(blk: np.ndarray) -> np.ndarray:
    """(rows, 256) unsigned 6-bit values of one Q6_K super-block."""
    q = np.empty((blk.shape[0], 256), np.int64)
    for h in range(2):
        for t in range(4):
            ql = blk[:, 64 * h + 32 * (t % 2):64 * h + 32 * (t % 2) + 32].astype(np.int64)
            qh = blk[:, 128 + 32 * h:160 + 32 * h].astype(np.int64)
            q[:, 128 * h + 32 * t:128 * h + 32 * t + 32] = ((ql >> (4 * (t // 2))) & 15) | (((qh >> (2 * t)) & 3) << 4)
    return q


def rowdot_q6_k(raw, xq, xd, xs) -> np.ndarray:
    acc = np.zeros((raw.shape[0], 8), F32)
    for b in range(xd.size):
        blk = raw[:, 210 * b:210 * b + 210]
        q = _q6_k_values(blk)
        sc = blk[:, 192:208].view(np.int8).astype(np.int64)  # (rows, 16)
        y = xq[256 * b:256 * b + 256].astype(np.int64)
        lanes = np.zeros((raw.shape[0], 8), np.int64)
        for c in range(8):  # 32-weight chunks; lane j: bytes 4j..4j+3, scale of its 16
            prod = (q[:, 32 * c:32 * c + 32] * y[32 * c:32 * c + 32]).reshape(-1, 8, 4).sum(-1)
            lanes += prod * np.repeat(sc[:, 2 * c:2 * c + 2], 4, axis=1)
        bs = xs[16 * b:16 * b + 16].astype(np.int64)
        lanes -= 32 * (sc[:, 0::2] * bs[0::2] + sc[:, 1::2] * bs[1::2])
        d = (xd[b] * _f16(blk, 208)).astype(F32)
        acc = fma(d[:, None], lanes.astype(F32), acc)
    return hsum8(acc)


def _q4_k_scales(blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, 8) 6-bit scales and mins of one Q4_K super-block."""
    s = blk[:, 4:16].astype(np.int64)
    sc = np.empty((blk.shape[0], 8), np.int64)
    mn = np.empty_like(sc)
    sc[:, :4], mn[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


def rowdot_q4_k(raw, xq, xd, xs, per_pair: bool) -> np.ndarray:
    """ggml's repacked Q4_K order: one fma per super-block (gemv) or per pair of 32-weight
    sub-blocks (gemm, per_pair), for the scaled sums and, apart, for the mins."""
    acc = np.zeros(raw.shape[0], F32)
    acc_m = np.zeros(raw.shape[0], F32)
    for b in range(xd.size):
        blk = raw[:, 144 * b:144 * b + 144]
        sc, mn = _q4_k_scales(blk)
        d = (_f16(blk, 0) * xd[b]).astype(F32)
        dmin = (_f16(blk, 2) * xd[b]).astype(F32)
        y = xq[256 * b:256 * b + 256].astype(np.int64)
        bs = xs[16 * b:16 * b + 16].astype(np.int64)
        isum = np.zeros(raw.shape[0], np.int64)
        msum = np.zeros(raw.shape[0], np.int64)
        for c in range(4):
            qs = blk[:, 16 + 32 * c:48 + 32 * c].astype(np.int64)
            for k, q in enumerate((qs & 15, qs >> 4)):
                sb = 2 * c + k
                isum += sc[:, sb] * (q * y[64 * c + 32 * k:64 * c + 32 * k + 32]).sum(-1)
                msum += mn[:, sb] * (bs[2 * sb] + bs[2 * sb + 1])
            if per_pair:
                acc, acc_m = fma(isum.astype(F32), d, acc), fma(msum.astype(F32), dmin, acc_m)
                isum[:], msum[:] = 0, 0
        if not per_pair:
            acc, acc_m = fma(isum.astype(F32), d, acc), fma(msum.astype(F32), dmin, acc_m)
    return (acc - acc_m).astype(F32)


def dot_f16(k: np.ndarray, q: np.ndarray, n_acc: int, bf16: bool = False) -> np.ndarray:
    """k float16 / float32 (rows, n), q float32 (n,): ggml's vec_dot_f16 (n_acc 4) or tinyBLAS
    (n_acc 1) order (see ir.dense.dot_f16); bf16: k holds bfloat16 values (as float32), and
    n_acc 4 is vec_dot_bf16 (its lanes summed as hsum_float_8)."""
    kf = k.astype(F32)
    acc = np.zeros((k.shape[0], n_acc, 8), F32)
    for c in range(k.shape[1] // 8):
        g = c % n_acc
        acc[:, g] = fma(kf[:, 8 * c:8 * c + 8], q[8 * c:8 * c + 8], acc[:, g])
    if n_acc == 1:
        return hsum8(acc[:, 0])
    s = ((acc[:, 0] + acc[:, 2]).astype(F32) + (acc[:, 1] + acc[:, 3]).astype(F32)).astype(F32)
    if bf16:
        return hsum8(s)
    t = [(s[:, i] + s[:, i + 4]).astype(F32) for i in range(4)]
    return ((t[0] + t[1]).astype(F32) + (t[2] + t[3]).astype(F32)).astype(F32)


def rowdot_q5_1(raw, xq, xd, xm) -> np.ndarray:
    """As rowdot_q4_1, the 5th bit of each weight adding 16."""
    acc = np.zeros((raw.shape[0], 8), F32)
    summs = np.zeros(raw.shape[0], F32)
    for b in range(xd.size):
        blk = raw[:, 24 * b:24 * b + 24]
        qh = np.ascontiguousarray(blk[:, 4:8]).view(np.uint32)[:, 0]
        high = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)
        q = _nibbles(blk[:, 8:24]).astype(np.int64) + 16 * high
        summs = fma(_f16(blk, 2), xm[b], summs)
        acc = fma((_f16(blk, 0) * xd[b]).astype(F32)[:, None], _quads(q, xq[32 * b:32 * b + 32]).astype(F32), acc)
    return (hsum8(acc) + summs).astype(F32)


def rowdot_q4_0(raw, xq, xd, xs) -> np.ndarray:
    """ggml's repacked Q4_0 order: per block acc = fma(sum((q - 8) x), d_w * d_x, acc)."""
    acc = np.zeros(raw.shape[0], F32)
    for b in range(xd.size):
        blk = raw[:, 18 * b:18 * b + 18]
        q = _nibbles(blk[:, 2:18]).astype(np.int64) - 8
        isum = (q * xq[32 * b:32 * b + 32]).sum(-1)
        acc = fma(isum.astype(F32), (_f16(blk, 0) * xd[b]).astype(F32), acc)
    return acc


def rowdot_q5_k(raw, xq, xd, xs) -> np.ndarray:
    """ggml's x86 vec_dot_q5_K: eight lanes of scaled integer sums per super-block into an 8-lane
    fma accumulator; the mins in one scalar fma chain with -d_x * dmin_w."""
    acc = np.zeros((raw.shape[0], 8), F32)
    summs = np.zeros(raw.shape[0], F32)
    for b in range(xd.size):
        blk = raw[:, 176 * b:176 * b + 176]
        sc, mn = _q4_k_scales(blk)
        qh = blk[:, 16:48].astype(np.int64)
        y = xq[256 * b:256 * b + 256].astype(np.int64)
        bs = xs[16 * b:16 * b + 16].astype(np.int64)
        lanes = np.zeros((raw.shape[0], 8), np.int64)
        msum = np.zeros(raw.shape[0], np.int64)
        for s in range(8):
            qs = blk[:, 48 + 32 * (s // 2):80 + 32 * (s // 2)].astype(np.int64)
            q = ((qs >> (4 * (s % 2))) & 15) | (((qh >> s) & 1) << 4)
            lanes += sc[:, s:s + 1] * (q * y[32 * s:32 * s + 32]).reshape(-1, 8, 4).sum(-1)
            msum += mn[:, s] * (bs[2 * s] + bs[2 * s + 1])
        acc = fma((xd[b] * _f16(blk, 0)).astype(F32)[:, None], lanes.astype(F32), acc)
        summs = fma((-xd[b] * _f16(blk, 2)).astype(F32), msum.astype(F32), summs)
    return (hsum8(acc) + summs).astype(F32)


def rowdot_q2_k(raw, xq, xd, xs) -> np.ndarray:
    """ggml's x86 vec_dot_q2_K: per super-block the mins' lanes (min * x sums of groups 2k, 2k+1)
    with -d_x * dmin_w, then the scaled integer lanes with d_x * d_w, into one 8-lane accumulator."""
    acc = np.zeros((raw.shape[0], 8), F32)
    for b in range(xd.size):
        blk = raw[:, 84 * b:84 * b + 84]
        sc = (blk[:, 0:16] & 15).astype(np.int64)
        mn = (blk[:, 0:16] >> 4).astype(np.int64)
        bs = xs[16 * b:16 * b + 16].astype(np.int64)
        y = xq[256 * b:256 * b + 256].astype(np.int64)
        mins = mn[:, 0::2] * bs[0::2] + mn[:, 1::2] * bs[1::2]
        acc = fma((-xd[b] * _f16(blk, 82)).astype(F32)[:, None], mins.astype(F32), acc)
        lanes = np.zeros((raw.shape[0], 8), np.int64)
        for j in range(2):
            bits = blk[:, 16 + 32 * j:48 + 32 * j].astype(np.int64)
            for k in range(4):
                q = (bits >> (2 * k)) & 3
                prod = (q * y[128 * j + 32 * k:128 * j + 32 * k + 32]).reshape(-1, 8, 4).sum(-1)
                g = 8 * j + 2 * k
                lanes += prod * np.repeat(sc[:, g:g + 2], 4, axis=1)
        acc = fma((xd[b] * _f16(blk, 80)).astype(F32)[:, None], lanes.astype(F32), acc)
    return hsum8(acc)


def _q3_k_parts(blk: np.ndarray):
    """(rows, 256) signed codes and (rows, 16) signed scales of one Q3_K super-block."""
    q = np.empty((blk.shape[0], 256), np.int64)
    for c in range(2):
        for s in range(4):
            low = (blk[:, 32 + 32 * c:64 + 32 * c].astype(np.int64) >> (2 * s)) & 3
            high = (blk[:, 0:32].astype(np.int64) >> (4 * c + s)) & 1
            q[:, 128 * c + 32 * s:128 * c + 32 * s + 32] = low + 4 * high - 4
    sb = blk[:, 96:108].astype(np.int64)
    sc = np.stack([((sb[:, g % 8] >> (4 * (g // 8))) & 15) | (((sb[:, 8 + g % 4] >> (2 * (g // 4))) & 3) << 4)
                   for g in range(16)], axis=1) - 32
    return q, sc


def rowdot_q3_k(raw, xq, xd) -> np.ndarray:
    """ggml's x86 vec_dot_q3_K: eight lanes of scaled integer sums per super-block (lane j: weights
    4j..4j+3 of every 32) into an 8-lane fma accumulator with d_x * d_w; hsum_float_8."""
    acc = np.zeros((raw.shape[0], 8), F32)
    for b in range(xd.size):
        blk = raw[:, 110 * b:110 * b + 110]
        q, sc = _q3_k_parts(blk)
        prod = q * xq[256 * b:256 * b + 256].astype(np.int64) * np.repeat(sc, 16, axis=1)
        lanes = prod.reshape(-1, 8, 8, 4).sum(axis=(1, 3))  # (chunk of 32, lane, byte)
        acc = fma((xd[b] * _f16(blk, 108)).astype(F32)[:, None], lanes.astype(F32), acc)
    return hsum8(acc)


def _k_parts(ggml_type: str, blk: np.ndarray):
    """One super-block of a K-quant: (rows, 256) signed codes, (rows, 16) scales and mins per 16
    weights (mins None without), d, dmin (float32 (rows,))."""
    if ggml_type == "q2_k":
        q = np.empty((blk.shape[0], 256), np.int64)
        for j in range(2):
            for k in range(4):
                q[:, 128 * j + 32 * k:128 * j + 32 * k + 32] = (blk[:, 16 + 32 * j:48 + 32 * j].astype(np.int64) >> (2 * k)) & 3
        sb = blk[:, 0:16].astype(np.int64)
        return q, sb & 15, sb >> 4, _f16(blk, 80), _f16(blk, 82)
    if ggml_type == "q3_k":
        q, sc = _q3_k_parts(blk)
        return q, sc, None, _f16(blk, 108), None
    if ggml_type in ("q4_k", "q5_k"):
        qs0 = 16 if ggml_type == "q4_k" else 48
        q = np.empty((blk.shape[0], 256), np.int64)
        for s in range(8):
            qs = blk[:, qs0 + 32 * (s // 2):qs0 + 32 + 32 * (s // 2)].astype(np.int64)
            q[:, 32 * s:32 * s + 32] = (qs >> (4 * (s % 2))) & 15
            if ggml_type == "q5_k":
                q[:, 32 * s:32 * s + 32] |= ((blk[:, 16:48].astype(np.int64) >> s) & 1) << 4
        sc, mn = _q4_k_scales(blk)
        return q, np.repeat(sc, 2, axis=1), np.repeat(mn, 2, axis=1), _f16(blk, 0), _f16(blk, 2)
    assert ggml_type == "q6_k"
    return _q6_k_values(blk) - 32, blk[:, 192:208].view(np.int8).astype(np.int64), None, _f16(blk, 208), None


K_BLOCK_BYTES = {"q2_k": 84, "q3_k": 110, "q4_k": 144, "q5_k": 176, "q6_k": 210}


def rowdot_tiled(ggml_type: str, raw, xq, xd, xs) -> np.ndarray:
    """llama.cpp's tiled product (batches of 8+ tokens, K-quants): per super-block the exact
    integers s1 = sum sc * q * x and s2 = sum min * (x sums of 16); res = d_w * f32(s1), with
    mins res = fma(-dmin_w, f32(s2), res); acc = fma(res, d_x, acc)."""
    size = K_BLOCK_BYTES[ggml_type]
    acc = np.zeros(raw.shape[0], F32)
    for b in range(xd.size):
        q, sc, mn, d, dmin = _k_parts(ggml_type, raw[:, size * b:size * b + size])
        s1 = (q * xq[256 * b:256 * b + 256].astype(np.int64) * np.repeat(sc, 16, axis=1)).sum(1)
        res = (d * s1.astype(F32)).astype(F32)
        if mn is not None:
            res = fma(-dmin, (mn * xs[16 * b:16 * b + 16].astype(np.int64)).sum(1).astype(F32), res)
        acc = fma(res, xd[b], acc)
    return acc


# --- IQ4_NL / IQ4_XS (kernels/cpu/iquants.py) ---------------------------------------------------
KVALUES_IQ4NL = np.array(quants.KVALUES_IQ4NL, np.int64)


def iq4_nl_values(blk: np.ndarray) -> np.ndarray:
    """(rows, 32) int64 signed values of one IQ4_NL block (rows, 18): low nibbles, then high."""
    return KVALUES_IQ4NL[_nibbles(blk[:, 2:18])]


def iq4_xs_scales(blk: np.ndarray) -> np.ndarray:
    """(rows, 8) int64: ls - 32 of each 32-weight sub-block of one IQ4_XS super-block (rows, 136)."""
    sh = blk[:, 2].astype(np.int64) | (blk[:, 3].astype(np.int64) << 8)
    s = np.arange(8)
    lo = (blk[:, 4 + s // 2].astype(np.int64) >> (4 * (s % 2))) & 15
    return (lo | (((sh[:, None] >> (2 * s)) & 3) << 4)) - 32


def iq4_xs_values(blk: np.ndarray) -> np.ndarray:
    """(rows, 256) int64 signed values of one IQ4_XS super-block (sub-block s from qs[16s:16s+16])."""
    return np.concatenate([KVALUES_IQ4NL[_nibbles(blk[:, 8 + 16 * s:24 + 16 * s])] for s in range(8)], axis=1)


def dequantize_iq4_nl(raw: np.ndarray) -> np.ndarray:
    """uint8 (rows, nb * 18) -> float32 (rows, nb * 32): w = d * kv[q]."""
    nb = raw.shape[1] // 18
    return np.concatenate([(_f16(raw[:, 18 * b:18 * b + 18], 0)[:, None] * iq4_nl_values(raw[:, 18 * b:18 * b + 18])
                            .astype(F32)).astype(F32) for b in range(nb)], axis=1)


def dequantize_iq4_xs(raw: np.ndarray) -> np.ndarray:
    """uint8 (rows, nb * 136) -> float32 (rows, nb * 256): w = (d * (ls - 32)) * kv[q]."""
    out = []
    for b in range(raw.shape[1] // 136):
        blk = raw[:, 136 * b:136 * b + 136]
        dl = (_f16(blk, 0)[:, None] * iq4_xs_scales(blk).astype(F32)).astype(F32)
        out.append((np.repeat(dl, 32, axis=1) * iq4_xs_values(blk).astype(F32)).astype(F32))
    return np.concatenate(out, axis=1)


def rowdot_iq4_nl(raw, xq, xd, order: str) -> np.ndarray:
    """IQ4_NL rows times one token's "q8_32" x in one of llama.cpp's orders:
    "repacked" (iq4_nl_8x8 gemv/gemm): per block acc = fma(f32(isum), d_w * d_x, acc);
    "vec_dot" (ggml_vec_dot_iq4_nl_q8_0): even / odd blocks in two 8-lane fma accumulators,
        hsum_float_8(acc1 + acc2), an odd last block as fma(d_x * d_w, f32(isum), sum);
    "tinyblas" (tinyBLAS_Q0_AVX): one 8-lane accumulator fma(d_w * d_x, lanes, acc), hsum."""
    nb = xd.size
    n = raw.shape[0]
    if order == "repacked":
        acc = np.zeros(n, F32)
        for b in range(nb):
            blk = raw[:, 18 * b:18 * b + 18]
            isum = (iq4_nl_values(blk) * xq[32 * b:32 * b + 32].astype(np.int64)).sum(-1)
            acc = fma(isum.astype(F32), (_f16(blk, 0) * xd[b]).astype(F32), acc)
        return acc
    accs = np.zeros((2, n, 8), F32)
    pairs = nb - nb % 2 if order == "vec_dot" else nb
    for b in range(pairs):
        blk = raw[:, 18 * b:18 * b + 18]
        lanes = _quads(iq4_nl_values(blk), xq[32 * b:32 * b + 32]).astype(F32)
        k = b % 2 if order == "vec_dot" else 0
        accs[k] = fma((_f16(blk, 0) * xd[b]).astype(F32)[:, None], lanes, accs[k])
    s = hsum8((accs[0] + accs[1]).astype(F32))
    if pairs < nb:
        b = nb - 1
        blk = raw[:, 18 * b:18 * b + 18]
        isum = (iq4_nl_values(blk) * xq[32 * b:32 * b + 32].astype(np.int64)).sum(-1)
        s = fma((xd[b] * _f16(blk, 0)).astype(F32), isum.astype(F32), s)
    return s


def rowdot_iq4_xs(raw, xq, xd, tiled: bool) -> np.ndarray:
    """IQ4_XS rows times one token's "q8_k" x: ggml_vec_dot_iq4_xs_q8_K (per super-block 8 integer
    lanes sum_s (ls_s - 32) * quad sums, acc = fma(d_w * d_x, f32(lanes), acc), hsum_float_8), or
    (tiled) llama.cpp's tiled order: res = d_w * f32(s1), acc = fma(res, d_x, acc)."""
    n = raw.shape[0]
    acc = np.zeros(n, F32) if tiled else np.zeros((n, 8), F32)
    for b in range(xd.size):
        blk = raw[:, 136 * b:136 * b + 136]
        prod = iq4_xs_values(blk) * xq[256 * b:256 * b + 256].astype(np.int64) * np.repeat(iq4_xs_scales(blk), 32, 1)
        if tiled:
            acc = fma((_f16(blk, 0) * prod.sum(-1).astype(F32)).astype(F32), xd[b], acc)
        else:
            lanes = prod.reshape(n, 8, 8, 4).sum(axis=(1, 3))  # (sub-block, lane, byte)
            acc = fma((_f16(blk, 0) * xd[b]).astype(F32)[:, None], lanes.astype(F32), acc)
    return acc if tiled else hsum8(acc)


# --- the grid IQ types (kernels/cpu/igrid.py) ---------------------------------------------------
# Per super-block of 256: 8-value (IQ2) or 4-value (IQ3) grid entries, a sign bit per weight, a
# 4-bit scale ls per 32 or 16 weights. The integer products use the odd multiplier 2 ls + 1 and a
# per-type float factor (IGRID_MULT); dequantization uses the float forms of gguf.quants.
IGRID_BYTES = {"IQ2_XXS": 66, "IQ2_XS": 74, "IQ2_S": 82, "IQ3_XXS": 98, "IQ3_S": 110}
IGRID_MULT = {"IQ2_XXS": 0.125, "IQ2_XS": 0.125, "IQ2_S": 0.125, "IQ3_XXS": 0.25, "IQ3_S": 1.0}


def igrid_tables(name: str) -> np.ndarray:
    """The type's grid as int64 (entries, 8 or 4), from gguf.quants."""
    import gguf.quants as gq

    cls = getattr(gq, name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape).astype(np.int64)


def _ksign_bits(idx: np.ndarray) -> np.ndarray:
    """(..., 8) bool: weight k of a group of 8 is negative, for 7-bit sign indices (ggml's ksigns:
    the eighth bit makes the count of negatives even)."""
    ks = np.frombuffer(__import__("gguf.quants").quants.IQ2_XXS.ksigns, np.uint8).astype(np.int64)
    return ((ks[idx][..., None] >> np.arange(8)) & 1).astype(bool)


def _byte_bits(b: np.ndarray) -> np.ndarray:
    return ((b.astype(np.int64)[..., None] >> np.arange(8)) & 1).astype(bool)


def igrid_parts(name: str, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One super-block of every row (rows, bytes) -> (d float32 (rows,), signed values int64
    (rows, 256), ls int64 (rows, 16): the 4-bit scale of each 16 weights)."""
    n = blk.shape[0]
    grid = igrid_tables(name)
    d = _f16(blk, 0)
    b = blk.astype(np.int64)
    if name == "IQ2_XXS":
        a = np.ascontiguousarray(blk[:, 2:66]).view(np.uint32).astype(np.int64).reshape(n, 8, 2)
        idx = b[:, 2:66].reshape(n, 8, 8)[:, :, :4]  # the first u32 of each pair: 4 grid bytes
        neg = _ksign_bits((a[:, :, 1:2] >> (7 * np.arange(4))) & 127)  # (n, 8, 4, 8)
        ls = np.repeat(a[:, :, 1] >> 28, 2, axis=1)
    elif name in ("IQ2_XS", "IQ2_S"):
        if name == "IQ2_XS":
            q = np.ascontiguousarray(blk[:, 2:66]).view(np.uint16).astype(np.int64).reshape(n, 8, 4)
            idx, neg = q & 511, _ksign_bits(q >> 9)
            sc = b[:, 66:74]
        else:
            qh = b[:, 66:74]
            idx = b[:, 2:34].reshape(n, 8, 4) | (((qh[:, :, None] >> (2 * np.arange(4))) & 3) << 8)
            neg = _byte_bits(b[:, 34:66]).reshape(n, 8, 4, 8)
            sc = b[:, 74:82]
        ls = np.stack([sc & 15, sc >> 4], axis=2).reshape(n, 16)
    elif name == "IQ3_XXS":
        a = np.ascontiguousarray(blk[:, 66:98]).view(np.uint32).astype(np.int64)  # (n, 8)
        idx = b[:, 2:66].reshape(n, 8, 8)
        neg = _ksign_bits((a[:, :, None] >> (7 * np.arange(4))) & 127)
        ls = np.repeat(a >> 28, 2, axis=1)
    elif name == "IQ3_S":
        qh = b[:, 66:74]
        idx = b[:, 2:66].reshape(n, 8, 8) | (((qh[:, :, None] >> np.arange(8)) & 1) << 8)
        neg = _byte_bits(b[:, 74:106]).reshape(n, 8, 4, 8)
        sc = b[:, 106:110]
        ls = np.repeat(np.stack([sc & 15, sc >> 4], axis=2).reshape(n, 8), 2, axis=1)
    else:
        raise ValueError(name)
    mag = grid[idx].reshape(n, 256)
    return d, np.where(neg.reshape(n, 256), -mag, mag), ls


def dequantize_igrid(name: str, raw: np.ndarray) -> np.ndarray:
    """uint8 (rows, nb * bytes) -> float32 (rows, nb * 256), gguf.quants' float steps:
    db = d * (0.5 + ls) * 0.25 (IQ2), d * (0.5 + ls) * 0.5 (IQ3_XXS), d * (1 + 2 ls) (IQ3_S);
    w = (db * |grid|) * sign."""
    size, out = IGRID_BYTES[name], []
    for j in range(raw.shape[1] // size):
        d, v, ls = igrid_parts(name, raw[:, size * j:size * j + size])
        if name == "IQ3_S":
            db = (d[:, None] * (1 + 2 * ls).astype(F32)).astype(F32)
        else:
            db = ((d[:, None] * (F32(0.5) + ls.astype(F32))).astype(F32)
                  * F32(0.25 if name.startswith("IQ2") else 0.5)).astype(F32)
        w = (np.repeat(db, 16, axis=1) * np.abs(v).astype(F32)).astype(F32)
        out.append(np.where(v < 0, -w, w))
    return np.concatenate(out, axis=1)


def rowdot_igrid(name: str, raw, xq, xd, tiled: bool) -> np.ndarray:
    """Grid-IQ rows times one token's "q8_k" x in llama.cpp's two orders:
    vec_dot (ggml_vec_dot_<t>_q8_K, AVX2): per super-block 8 integer lanes, lane j the sum over
        sub-blocks of (2 ls + 1) * the products of weights 4j .. 4j + 3; acc = fma(d_w * d_x,
        f32(lanes), acc); mult * hsum_float_8(acc);
    tiled (8 tokens or more): res = (d_w * mult) * f32(s1), s1 the exact scaled sum;
        acc = fma(res, d_x, acc)."""
    n, size, mult = raw.shape[0], IGRID_BYTES[name], F32(IGRID_MULT[name])
    acc = np.zeros(n, F32) if tiled else np.zeros((n, 8), F32)
    for b in range(xd.size):
        d, v, ls = igrid_parts(name, raw[:, size * b:size * b + size])
        prod = v * xq[256 * b:256 * b + 256].astype(np.int64) * np.repeat(2 * ls + 1, 16, axis=1)
        if tiled:
            acc = fma(((d * mult).astype(F32) * prod.sum(-1).astype(F32)).astype(F32), xd[b], acc)
        else:
            lanes = prod.reshape(n, 8, 8, 4).sum(axis=(1, 3))
            acc = fma((d * xd[b]).astype(F32)[:, None], lanes.astype(F32), acc)
    return acc if tiled else (mult * hsum8(acc)).astype(F32)


TQ_BYTES = {"TQ1_0": 54, "TQ2_0": 66}


def tq_codes(name: str, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One TQ super-block of every row -> (d float32 (rows,), codes int64 (rows, 256): weight + 1)."""
    n = blk.shape[0]
    b = blk.astype(np.int64)
    if name == "TQ2_0":
        codes = (b[:, :64].reshape(n, 2, 1, 32) >> (2 * np.arange(4))[:, None]) & 3  # (n, half, shift, byte)
        return _f16(blk, 64), codes.reshape(n, 256)
    digit = lambda q, k: (((q[..., None, :] * 3 ** np.arange(k)[:, None]) & 255) * 3) >> 8  # noqa: E731
    codes = np.concatenate([digit(b[:, :32], 5).reshape(n, 160), digit(b[:, 32:48], 5).reshape(n, 80),
                            digit(b[:, 48:52], 4).reshape(n, 16)], axis=1)
    return _f16(blk, 52), codes


def rowdot_tq(name: str, raw, xq, xd, xs) -> np.ndarray:
    """TQ rows times one token's "q8_k" x as ggml_vec_dot_<t>_q8_K (AVX2), every batch size: lane j
    = the products of codes and x at bytes 4j .. 4j + 3 of each 32, less x's sums of 16 number 2j
    and 2j + 1; acc = fma(d_w * d_x, f32(lanes), acc); hsum_float_8."""
    n, size = raw.shape[0], TQ_BYTES[name]
    acc = np.zeros((n, 8), F32)
    for b in range(xd.size):
        d, codes = tq_codes(name, raw[:, size * b:size * b + size])
        lanes = (codes * xq[256 * b:256 * b + 256].astype(np.int64)).reshape(n, 8, 8, 4).sum(axis=(1, 3))
        lanes -= xs[16 * b:16 * b + 16].astype(np.int64).reshape(8, 2).sum(1)
        acc = fma((d * xd[b]).astype(F32)[:, None], lanes.astype(F32), acc)
    return hsum8(acc)


def iq1_parts(name: str, blk: np.ndarray):
    """One IQ1_S / IQ1_M super-block of every row -> (d float32 (rows,), grid values -1 / 0 / 1 and
    delta signs +-1, int64 (rows, 256) each, ls int64 (rows, 16): the 3-bit scale of each 16)."""
    import gguf.quants as gq

    gq.IQ1_S.init_grid()
    grid = gq.IQ1_S.grid.reshape(2048, 8).astype(np.int64)
    n = blk.shape[0]
    b = blk.astype(np.int64)
    if name == "IQ1_S":
        hw = np.ascontiguousarray(blk[:, 34:50]).view(np.uint16).astype(np.int64)  # (n, 8)
        idx = b[:, 2:34].reshape(n, 8, 4) | (((hw[:, :, None] >> (3 * np.arange(4))) & 7) << 8)
        neg = np.repeat((hw >> 15) & 1, 32, axis=1)
        ls = np.repeat((hw >> 12) & 7, 2, axis=1)
        d = _f16(blk, 0)
    else:
        nib = (b[:, 32:48, None] >> np.array([0, 4])) & 15  # (n, 16, 2): per 8 weights
        nib = nib.reshape(n, 32)
        idx = b[:, :32] | ((nib & 7) << 8)
        neg = np.repeat((nib >> 3) & 1, 8, axis=1)
        sc = np.ascontiguousarray(blk[:, 48:56]).view(np.uint16).astype(np.int64)  # (n, 4)
        ls = ((sc[:, :, None] >> (3 * np.arange(4))) & 7).reshape(n, 16)
        h = sum(((sc[:, k] >> 12) & 15) << (4 * k) for k in range(4)).astype(np.uint16)
        d = h.view(np.float16).astype(F32)
    return d, grid[idx].reshape(n, 256), np.where(neg == 1, -1, 1), ls


def rowdot_iq1(name: str, raw, xq, xd, tiled: bool) -> np.ndarray:
    """IQ1 rows times one token's "q8_k" x in llama.cpp's two orders:
    vec_dot (AVX2): lanes of (2 ls + 1) * grid * x as for the grid types, acc = fma(d_w * d_x,
        f32(lanes), acc); the deltas' part as lanes (IQ1_M, a second 8-lane accumulator) or their
        integer sum (IQ1_S, a scalar fma); hsum_float_8(acc) + 1/8 * (hsum of) the delta part;
    tiled (8 tokens or more): codes 8 * grid + delta sign, res = (d_w / 8) * f32(s1),
        acc = fma(res, d_x, acc)."""
    n, size = raw.shape[0], {"IQ1_S": 50, "IQ1_M": 56}[name]
    acc = np.zeros(n, F32) if tiled else np.zeros((n, 8), F32)
    acc2 = np.zeros((n, 8), F32)
    for b in range(xd.size):
        d, g, delta, ls = iq1_parts(name, raw[:, size * b:size * b + size])
        y = xq[256 * b:256 * b + 256].astype(np.int64)
        scale = np.repeat(2 * ls + 1, 16, axis=1)
        if tiled:
            s1 = ((8 * g + delta) * y * scale).sum(-1)
            acc = fma(((d * F32(0.125)).astype(F32) * s1.astype(F32)).astype(F32), xd[b], acc)
            continue
        dd = (d * xd[b]).astype(F32)[:, None]
        acc = fma(dd, (g * y * scale).reshape(n, 8, 8, 4).sum(axis=(1, 3)).astype(F32), acc)
        lanes2 = (delta * y * scale).reshape(n, 8, 8, 4).sum(axis=(1, 3))
        if name == "IQ1_M":
            acc2 = fma(dd, lanes2.astype(F32), acc2)
        else:
            acc2[:, 0] = fma(dd[:, 0], lanes2.sum(-1).astype(F32), acc2[:, 0])
    if tiled:
        return acc
    part2 = hsum8(acc2) if name == "IQ1_M" else acc2[:, 0]
    return (hsum8(acc) + (F32(0.125) * part2).astype(F32)).astype(F32)


def c_expf():
    """The C library's expf (what Numba's float32 exp calls, and ggml's flash attention)."""
    import ctypes
    import ctypes.util
    import math

    name = ctypes.util.find_library("m")
    if name is None:  # no separate libm: float64 exp rounded once (equal but at rounding ties)
        return lambda x: F32(math.exp(float(x)))
    f = ctypes.CDLL(name).expf
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return lambda x: F32(f(float(x)))


def kv_block_values(blocks: np.ndarray, q4: bool) -> tuple[np.ndarray, np.ndarray]:
    """Rows of q8_0 (34-byte) or q4_0 (18-byte) cache blocks, uint8 (rows, row bytes) -> the int32
    values (rows, n) and float32 scales (rows, n / 32)."""
    b = blocks.reshape(blocks.shape[0], -1, 18 if q4 else 34)
    d = np.ascontiguousarray(b[:, :, :2]).view(np.float16)[..., 0].astype(F32)
    if q4:
        qs = b[:, :, 2:].astype(np.int32)
        vals = np.concatenate([qs & 15, qs >> 4], axis=2) - 8
    else:
        vals = np.ascontiguousarray(b[:, :, 2:]).view(np.int8).astype(np.int32)
    return vals.reshape(b.shape[0], -1), d


def flash_attn_quant(qq: np.ndarray, qd: np.ndarray, keys: np.ndarray, values: np.ndarray, k_q4: bool,
                     v_q4: bool, scale) -> np.ndarray:
    """float32 (hdv,): one head of one token through ggml's CPU flash attention over its visible keys,
    in order (flash.attend_flash_quant's reference). qq int8 (hd,) / qd float32 (hd / 32,): the query
    as Q8_0 blocks; keys / values uint8 (n, row bytes): the cache rows."""
    expf = c_expf()
    kq, kd = kv_block_values(keys, k_q4)
    n = kq.shape[0]
    acc = np.zeros((n, 8), F32)
    for b in range(kd.shape[1]):  # vec_dot_{q8_0,q4_0}_q8_0: d_k * d_q times 8 lanes of 4 products
        d = (kd[:, b] * qd[b]).astype(F32)
        isum = (kq[:, 32 * b:32 * b + 32] * qq[32 * b:32 * b + 32].astype(np.int32)).reshape(n, 8, 4).sum(-1)
        acc = fma(d[:, None], isum.astype(F32), acc)
    s = (hsum8(acc) * F32(scale)).astype(F32)
    vq, vd = kv_block_values(values, v_q4)
    v = (vq.astype(F32).reshape(n, -1, 32) * vd[:, :, None]).astype(F32).reshape(n, -1)
    m, total = F32(-np.inf), F32(0.0)
    out = np.zeros(v.shape[1], F32)
    for j in range(n):  # the online softmax
        ms = vs = F32(1.0)
        if s[j] > m:
            m_old, m = m, s[j]
            ms = expf(m_old - m)
            out = (out * ms).astype(F32)
        else:
            vs = expf(s[j] - m)
        out = fma(v[j], vs, out)
        total = fma(total, ms, vs)
    inv = F32(0.0) if total == 0 else F32(F32(1.0) / total)
    return (out * inv).astype(F32)


# --- flash attention over an f16 cache (ggml-cpu/ops.cpp, ggml_compute_forward_flash_attn_ext_f16) ---
# One query row of one head sees its visible keys in cache order; a key's cell (its index in
# llama.cpp's cache, the key's position in a fresh context) places it in a 64-key tile (tiled
# kernel) or a thread's range of cells (split-KV). Three kernels, chosen by the batch:
#   "one_chunk": decode with fewer than 512 cells, or 2..63 query rows;
#   "tiled":     64 or more query rows;
#   "split":     one query row and 512 or more cells (n_cells: the cache view, padded to 256),
#                the cells cut into n_split (llama.cpp's thread count) ranges.
def _flash_f16_partial(q, keys, values, scale):
    """(M, S, VKQ float32 (hdv,)) of ggml's one-chunk kernel over these keys, not yet divided by S:
    the query rounded to f16, scores by vec_dot_f16, an online softmax with glibc's expf, the value
    sum kept in f16 (rounded after every key: ggml_vec_scale_f16 / ggml_vec_mad_f16)."""
    expf = c_expf()
    qh = np.asarray(q, F32).astype(np.float16).astype(F32)
    s_all = (dot_f16(np.asarray(keys, np.float16), qh, 4) * F32(scale)).astype(F32) if len(keys) else []
    m, total = F32(-np.inf), F32(0.0)
    acc = np.zeros(values.shape[1], F32)
    v = np.asarray(values, np.float16).astype(F32)
    for j, s in enumerate(s_all):
        ms = vs = F32(1.0)
        if s > m:
            ms = expf(m - s)
            m = s
            acc = (acc * ms).astype(np.float16).astype(F32)
        else:
            vs = expf(s - m)
        acc = fma(v[j], vs, acc).astype(np.float16).astype(F32)
        total = fma(total, ms, vs)
    return m, total, acc


def _flash_f16_tiled(q, keys, values, cells, scale):
    """ggml's tiled kernel for one query row: Q in float32, the scores of a 64-cell tile as fma
    chains over the head dimension (simd_gemm), the tile's maximum folded into M (glibc expf
    rescales), its probabilities by ggml's vectorized exp summed as ggml_vec_soft_max_f32 does
    (8-lane float32 chunks, the chunks in float64, added to S in float64 once per tile), the
    values accumulated in float32 by fma in key order."""
    from edgellm.kernels.cpu.numpy_backend import softmax_total, expf_ggml

    expf = c_expf()
    q = np.asarray(q, F32)
    k = np.asarray(keys, np.float16).astype(F32)
    v = np.asarray(values, np.float16).astype(F32)
    cells = np.asarray(cells, np.int64)
    m, total = F32(-np.inf), F32(0.0)
    acc = np.zeros(v.shape[1], F32)
    for tile in np.unique(cells // 64):
        idx = np.nonzero(cells // 64 == tile)[0]
        kq = np.zeros(len(idx), F32)
        for d in range(k.shape[1]):
            kq = fma(q[d], k[idx, d], kq)
        kq = (kq * F32(scale)).astype(F32)
        m_new = max(m, kq.max())
        if m_new > m:
            ms = expf(m - m_new)
            acc = (acc * ms).astype(F32)
            total = F32(total * ms)
        m = m_new
        row = np.full(64, -np.inf, F32)
        row[cells[idx] % 64] = kq
        p = np.where(row == -np.inf, F32(0.0), expf_ggml((row - m).astype(F32))).astype(F32)
        total = F32(np.float64(total) + softmax_total(p)[0])
        for i, j in enumerate(idx):
            acc = fma(p[cells[j] % 64], v[j], acc)
    inv = F32(0.0) if total == 0 else F32(F32(1.0) / total)
    return (acc * inv).astype(F32)


def flash_attn_f16(q, keys, values, cells, scale, kernel: str, n_cells: int = 0, n_split: int = 1) -> np.ndarray:
    """float32 (hdv,): one head of one query row through ggml's CPU flash attention over an f16
    cache (flash.attend_flash_f16's reference). q float32 (hd,); keys float16 (n, hd), values
    float16 (n, hdv): the row's visible keys in cache order; cells int (n,): their cache cells;
    kernel "one_chunk", "tiled" or "split" (see above)."""
    if kernel == "tiled":
        return _flash_f16_tiled(q, keys, values, cells, scale)
    if kernel == "one_chunk":
        _, total, acc = _flash_f16_partial(q, keys, values, scale)
        inv = F32(0.0) if total == 0 else F32(F32(1.0) / total)
        return (acc * inv).astype(F32)
    assert kernel == "split"
    expf = c_expf()
    cells = np.asarray(cells, np.int64)
    chunk = -(-n_cells // n_split)
    m_f, s_f = F32(-np.inf), F32(0.0)
    acc_f = np.zeros(values.shape[1], F32)
    for i in range(n_split):  # ggml_flash_attn_ext_reduce_partials, in chunk order
        sel = (cells >= i * chunk) & (cells < (i + 1) * chunk)
        m_c, s_c, acc_c = _flash_f16_partial(q, keys[sel], values[sel], scale)
        if s_c == 0:
            continue
        m_new = max(m_f, m_c)
        so, sn = expf(m_f - m_new), expf(m_c - m_new)
        acc_f = fma(acc_f, so, (acc_c * sn).astype(F32))
        s_f = fma(s_f, so, F32(s_c * sn))
        m_f = m_new
    if s_f != 0:
        acc_f = (acc_f * F32(F32(1.0) / s_f)).astype(F32)
    return acc_f


def flash_kernel(n_rows: int, n_cells: int) -> str:
    """Which of ggml's f16 flash-attention kernels runs for a batch of n_rows query rows of one
    sequence over a cache view of n_cells cells (llama.cpp's n_kv, padded to 256)."""
    if n_rows == 1 and n_cells >= 512:
        return "split"
    return "tiled" if n_rows >= 64 else "one_chunk"


def flash_cells(n_used: int) -> int:
    """llama.cpp's n_kv for a cache whose highest used cell is n_used - 1: max(256, n_used padded to
    256) (llama_kv_cache::get_n_kv with flash attention's padding)."""
    return max(256, -(-n_used // 256) * 256)
