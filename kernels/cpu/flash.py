"""Flash attention in ggml's order: over a block-quantized cache (attend_flash_quant) and over an f16
cache (attend_flash_f16, attend_flash_f16_tiled), as llama.cpp's CPU backend runs them with flash
attention on. The NumPy twins are in kernels/cpu/reference.py; tests/test_flash_attn.py and
tests/test_ggml_order.py hold them together.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from edgellm.kernels.cpu.common import U
from edgellm.kernels.cpu.ir.attention import cache_load, cache_store
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.dense import dot_f16
from edgellm.kernels.cpu.ir.vecmath import exp_shifted

F32 = np.float32
NEG_INF = F32(-np.inf)


# --- flash attention over a block-quantized cache, in ggml's order ---------------------------------
# llama.cpp runs a q8_0 / q4_0 cache through its flash-attention op (it needs it for a quantized V).
# On the CPU (ggml_compute_forward_flash_attn_ext_f16_one_chunk, the path for quantized K and V) each
# query row is converted to K's dot type (Q8_0 blocks, quantize_row_q8_0), then for every visible key
# in cache order: s = vec_dot_{q8_0,q4_0}_q8_0(k, q) * scale (per block: d_k * d_q times the block's
# eight int32 sums of four products, accumulated by fma into eight float lanes, hsum_float_8 at the
# end); an online softmax (a new maximum M scales the sum of values by expf(Mold - M), else the value
# is weighted by expf(s - M)); the value row dequantized to float32 and added by fma; S = S * ms + vs
# as one fma (the compiler contracts it; without that the logits differ); finally the values times 1 / S.
@njit(inline="always")
def _cache_f16(row, o):
    return cache_load(np.uint16(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8))))


@njit(inline="always")
def _cache_q(row, o, e, q4):
    """Value e (0..31) of the block at byte o of a q8_0 (q4 False) or q4_0 (True) row, as an int."""
    if q4:
        byte = np.int32(row[o + 2 + (e & 15)])
        return ((byte >> 4) if e >= 16 else (byte & 15)) - 8
    return np.int32(np.int8(row[o + 2 + e]))


@njit(cache=True, nogil=True, parallel=True)
def attend_flash_quant(qq, qd, kc, vc, k_q4, v_q4, kpos, kmap, kbeg, kend, pos, window, scale, out):
    """out (n_tok, n_head * hdv) float32 = ggml's CPU flash attention over a block-quantized cache.
    qq int8 (n_tok, n_head, hd) and qd float32 (n_tok, n_head, hd / 32): the queries as Q8_0 blocks
    (kernels.cpu.quantize "q8_32": the d already rounded to f16); kc, vc uint8 (n_slots, n_kv,
    row bytes): the cache's q8_0 (34-byte) or q4_0 (18-byte, k_q4 / v_q4) blocks; token t attends
    to the slots kmap[kbeg[t]:kend[t]] in that order, skipping keys it may not see."""
    n_tok, n_head, hd = qq.shape
    n_kv = kc.shape[1]
    g = n_head // n_kv
    kbytes = 18 if k_q4 else 34
    vbytes = 18 if v_q4 else 34
    nbk = hd // 32
    nbv = vc.shape[2] // vbytes
    hdv = nbv * 32
    for th in prange(n_tok * n_head):
        t = th // n_head
        h = th - t * n_head
        kh = h // g
        p = pos[t]
        lanes = np.empty(8, F32)
        vkq = np.zeros(hdv, F32)
        m = NEG_INF
        s_sum = F32(0.0)
        for j in range(kbeg[t], kend[t]):
            slot = kmap[j]
            kp = kpos[slot]
            if kp < 0 or kp > p or (window > 0 and p - kp >= window):
                continue
            krow = kc[slot, kh]
            for li in range(8):
                lanes[li] = F32(0.0)
            for b in range(nbk):
                o = b * kbytes
                d = _cache_f16(krow, o) * qd[t, h, b]
                for li in range(8):
                    isum = np.int32(0)
                    for i in range(4):
                        e = 4 * li + i
                        isum += _cache_q(krow, o, e, k_q4) * np.int32(qq[t, h, 32 * b + e])
                    lanes[li] = fma32(d, F32(isum), lanes[li])
            s = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
            s = s * scale
            ms = F32(1.0)
            vs = F32(1.0)
            if s > m:
                m_old = m
                m = s
                ms = np.exp(F32(m_old - m))
                for d_ in range(hdv):
                    vkq[d_] = vkq[d_] * ms
            else:
                vs = np.exp(F32(s - m))
            vrow = vc[slot, kh]
            for b in range(nbv):
                o = b * vbytes
                dv = _cache_f16(vrow, o)
                for e in range(32):
                    vkq[32 * b + e] = fma32(F32(_cache_q(vrow, o, e, v_q4)) * dv, vs, vkq[32 * b + e])
            s_sum = fma32(s_sum, ms, vs)
        inv = F32(0.0) if s_sum == F32(0.0) else F32(1.0) / s_sum
        for d_ in range(hdv):
            out[t, h * hdv + d_] = vkq[d_] * inv


# --- flash attention over an f16 cache, in ggml's order ---------------------------------------------
# llama.cpp with flash attention on (its tools' default on the CPU) reads an f16 cache with one of
# three kernels of ggml-cpu/ops.cpp, picked per batch (reference.flash_kernel): one-chunk (the
# query rounded to f16, vec_dot_f16 scores, an online softmax with glibc's expf and the value sum
# held in f16, rounded after every key), tiled (64 or more query rows: f32 scores as fma chains,
# a softmax per 64-cell tile with ggml's vectorized exp and a float64 sum, f32 value sums) and
# split-KV (one query row, 512 or more cells: one-chunk partials over n_split cell ranges, merged
# in range order). A key's cell is its position (a fresh context's cache holds position p in cell
# p). attend_flash_f16 runs one-chunk and split-KV rows, attend_flash_f16_tiled a tiled chunk;
# reference.flash_attn_f16 is their twin.
FA_ONE_CHUNK, FA_TILED, FA_SPLIT = 0, 1, 2


@njit(inline="always")
def _fa_visible(kp, p, window, lo, hi):
    return kp >= lo and kp < hi and kp >= 0 and kp <= p and not (window > 0 and p - kp >= window)


@njit(inline="always")
def _fa_one_chunk(kf, vf, kmap, kpos, j0, j1, kstride, vstride, row_k, row_v, hd, hdv, p, window, lo, hi, qr, scale,
                  vkq, z):
    """ggml's one-chunk kernel over the visible keys of slots kmap[j0:j1] with cells in [lo, hi):
    returns (M, S), vkq float32 (hdv,) = the f16 value sum (not yet divided by S). row_k / row_v:
    the element offset of this KV head in a slot's row (kstride / vstride elements); qr: the query
    rounded to f16."""
    for d in range(hdv):
        vkq[d] = F32(0.0)
    m = NEG_INF
    s_sum = F32(0.0)
    for j in range(j0, j1):
        slot = kmap[j]
        if not _fa_visible(kpos[slot], p, window, lo, hi):
            continue
        s = dot_f16(kf, U(slot) * U(kstride) + U(row_k), qr, U(0), U(hd), 4) * scale
        ms = F32(1.0)
        vs = F32(1.0)
        if s > m:
            ms = np.exp(F32(m - s))
            m = s
            for d in range(hdv):
                vkq[d] = cache_load(cache_store(vkq[d] * ms, z))
        else:
            vs = np.exp(F32(s - m))
        vo = slot * vstride + row_v
        for d in range(hdv):
            vkq[d] = cache_load(cache_store(fma32(cache_load(vf[vo + d]), vs, vkq[d]), z))
        s_sum = fma32(s_sum, ms, vs)
    return m, s_sum


@njit(cache=True, nogil=True, parallel=True)
def attend_flash_f16(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, kernel, n_cells, n_split, out):
    """out (n_tok, n_head * hdv) float32 = ggml's CPU flash attention over an f16 cache.
    q float32 (n_tok, n_head, hd) (hd a multiple of 32); kc, vc uint16 (n_slots, n_kv, hd / hdv):
    the cache's f16 bits; token t attends to the slots kmap[kbeg[t]:kend[t]] (position order),
    skipping keys it may not see, with kernel[t] (FA_ONE_CHUNK or FA_SPLIT: n_cells[t] cells cut
    into n_split ranges; rows marked FA_TILED are left to attend_flash_f16_tiled)."""
    n_tok, n_head, hd = q.shape
    n_kv = kc.shape[1]
    hdv = vc.shape[2]
    g = n_head // n_kv
    kf = kc.reshape(-1)
    vf = vc.reshape(-1)
    kstride = n_kv * hd
    vstride = n_kv * hdv
    z = np.uint16(0)
    big = np.int64(1) << 62
    for th in prange(n_tok * n_head):
        t = th // n_head
        h = th - t * n_head
        kh = h // g
        p = pos[t]
        row_k = kh * hd
        row_v = kh * hdv
        if kernel[t] == FA_TILED:  # (attend_flash_f16_tiled's rows)
            continue
        vkq = np.empty(hdv, F32)
        qr = np.empty(hd, F32)
        for d in range(hd):
            qr[d] = cache_load(cache_store(q[t, h, d], z))
        if kernel[t] == FA_ONE_CHUNK:
            _, s_sum = _fa_one_chunk(kf, vf, kmap, kpos, kbeg[t], kend[t], kstride, vstride, row_k, row_v, hd, hdv,
                                     p, window, np.int64(0), big, qr, scale, vkq, z)
            inv = F32(0.0) if s_sum == F32(0.0) else F32(1.0) / s_sum
            for d in range(hdv):
                out[t, h * hdv + d] = F32(vkq[d]) * inv
            continue
        # split-KV: partials over n_split cell ranges, reduced in range order
        acc = np.zeros(hdv, F32)
        m_f = NEG_INF
        s_f = F32(0.0)
        chunk = (n_cells[t] + n_split - 1) // n_split
        for i in range(n_split):
            m_c, s_c = _fa_one_chunk(kf, vf, kmap, kpos, kbeg[t], kend[t], kstride, vstride, row_k, row_v, hd, hdv, p,
                                     window,
                                     i * chunk, (i + 1) * chunk, qr, scale, vkq, z)
            if s_c == F32(0.0):
                continue
            m_new = max(m_f, m_c)
            so = np.exp(F32(m_f - m_new))
            sn = np.exp(F32(m_c - m_new))
            for d in range(hdv):
                acc[d] = fma32(acc[d], so, vkq[d] * sn)
            s_f = fma32(s_f, so, s_c * sn)
            m_f = m_new
        inv = F32(1.0) / s_f if s_f != F32(0.0) else F32(1.0)
        for d in range(hdv):
            out[t, h * hdv + d] = acc[d] * inv


@njit(cache=True, nogil=True, parallel=True)
def attend_flash_f16_tiled(q, kc, vc, kpos, kmap, j0, j1, pos, window, scale, out):
    """out (n_tok, n_head * hdv) float32 = ggml's tiled flash-attention kernel (64 or more rows of
    one sequence) over an f16 cache: every row attends to the slots kmap[j0:j1] (position order),
    skipping keys it may not see. Per row: Q in f32; per 64-cell tile with a key it sees, scores
    as fma chains over d from 0 (simd_gemm), M = max(M, tile max) (glibc expf rescales the f32
    value sum and S), probabilities by ggml's vectorized exp, their 8-lane sums added in float64
    to S once per tile, values added by fma in key order; finally times 1 / S. Rows go by 64
    (ggml's q tile) so that a tile's keys are converted once for all of them."""
    n_tok, n_head, hd = q.shape
    n_kv = kc.shape[1]
    hdv = vc.shape[2]
    g = n_head // n_kv
    kf = kc.reshape(-1)
    vf = vc.reshape(-1)
    kstride = n_kv * hd
    vstride = n_kv * hdv
    n_qt = (n_tok + 63) // 64
    for blk in prange(n_qt * n_head):
        qt = blk // n_head
        h = blk - qt * n_head
        kh = h // g
        r0 = qt * 64
        nr = min(64, n_tok - r0)
        kt = np.empty((hd, 64), F32)  # the tile's keys, transposed
        vt = np.empty((64, hdv), F32)
        vkq = np.zeros((64, hdv), F32)
        m = np.full(64, NEG_INF, F32)
        s_sum = np.zeros(64, F32)
        pt = np.empty(64, F32)
        kq = np.empty(64, F32)
        tpos = np.empty(64, np.int64)
        p_lo = pos[r0]
        p_hi = pos[r0]
        for r in range(nr):
            p_lo = min(p_lo, pos[r0 + r])
            p_hi = max(p_hi, pos[r0 + r])
        j = j0
        while j < j1:
            # the next 64-cell tile's keys that some row of this q tile may see
            n = 0
            tile = np.int64(-1)
            while j < j1:
                slot = kmap[j]
                kp = kpos[slot]
                if kp < 0 or kp > p_hi or (window > 0 and p_lo - kp >= window):
                    j += 1
                    continue
                if n > 0 and kp // 64 != tile:
                    break
                tile = kp // 64
                tpos[n] = kp
                ko = slot * kstride + kh * hd
                for d in range(hd):
                    kt[d, n] = cache_load(kf[ko + d])
                vo = slot * vstride + kh * hdv
                for d in range(hdv):
                    vt[n, d] = cache_load(vf[vo + d])
                n += 1
                j += 1
            if n == 0:
                break
            for r in range(nr):
                p = pos[r0 + r]
                seen = False
                for i in range(n):
                    if _fa_visible(tpos[i], p, window, np.int64(0), p + 1):
                        seen = True
                if not seen:
                    continue
                for i in range(n):
                    kq[i] = F32(0.0)
                for d in range(hd):
                    qd = q[r0 + r, h, d]
                    for i in range(n):
                        kq[i] = fma32(qd, kt[d, i], kq[i])
                for i in range(64):
                    pt[i] = NEG_INF
                tmax = NEG_INF
                for i in range(n):
                    if _fa_visible(tpos[i], p, window, np.int64(0), p + 1):
                        sc = kq[i] * scale
                        pt[tpos[i] - tile * 64] = sc
                        if sc > tmax:
                            tmax = sc
                m_new = max(m[r], tmax)
                if m_new > m[r]:
                    ms = np.exp(F32(m[r] - m_new))
                    for d in range(hdv):
                        vkq[r, d] = vkq[r, d] * ms
                    s_sum[r] = s_sum[r] * ms
                m[r] = m_new
                exp_shifted(pt, U(64), m_new)  # -inf (no key there, or one it may not see) -> 0
                total = 0.0
                for c in range(0, 64, 8):
                    t0 = pt[c] + pt[c + 4]
                    t1 = pt[c + 1] + pt[c + 5]
                    t2 = pt[c + 2] + pt[c + 6]
                    t3 = pt[c + 3] + pt[c + 7]
                    total += np.float64((t0 + t2) + (t1 + t3))
                s_sum[r] = F32(np.float64(s_sum[r]) + total)
                for i in range(n):
                    if _fa_visible(tpos[i], p, window, np.int64(0), p + 1):
                        pv = pt[tpos[i] - tile * 64]
                        for d in range(hdv):
                            vkq[r, d] = fma32(pv, vt[i, d], vkq[r, d])
        for r in range(nr):
            inv = F32(0.0) if s_sum[r] == F32(0.0) else F32(1.0) / s_sum[r]
            for d in range(hdv):
                out[r0 + r, h * hdv + d] = vkq[r, d] * inv
