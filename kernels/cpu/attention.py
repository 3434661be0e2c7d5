"""Attention in ggml's summation order (flash attention off), over the paged f16 or f32 KV cache:
attend_ggml (a batch, head by head), attend_decode (decode tokens, the heads of a KV head
together) and attend_batch (a prompt batch over a cache window, tinyBLAS's order). The NumPy twins
are NumpyBackend.attention and kernels/cpu/reference.py; tests/test_ggml_order.py holds them
together.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from edgellm.kernels.cpu.common import U
from edgellm.kernels.cpu.host import REGS32
from edgellm.kernels.cpu.ir.attention import (axpy_f16, cache_load, cache_store, dot4_heads1, dot4_heads2, dot4_heads3,
                                              pv_lanes1, pv_lanes2, pv_lanes3, pv_lanes4, pv_t, scores_heads1,
                                              scores_heads2, scores_heads3, scores_heads4)
from edgellm.kernels.cpu.ir.dense import dot_f16
from edgellm.kernels.cpu.ir.vecmath import exp_shifted, expf_ggml

F32 = np.float32
NEG_INF = F32(-np.inf)
ATTN_CHUNKS = 64  # attend_ggml: parallel chunks of (token, head) pairs (scratch allocated per chunk)


# --- attention in ggml's summation order ------------------------------------------------------
# llama.cpp (no flash attention) computes KQ = K q and out = V^T P as f16 matrix products: for one
# token with ggml's vec_dot_f16 (four 8-lane accumulators: element i goes to lane i % 8 of
# accumulator (i / 8) % 4), for a batch with llamafile's tinyBLAS (one 8-lane accumulator); the
# softmax scales, masks, subtracts the max, takes ggml's vectorized exp and sums 8-lane chunks
# into a float64 total. Following that order makes attention the same bits as llama.cpp's.
@njit(inline="always")
def _soft_cap(raw, cap, inv_cap):
    """Gemma-2's attention soft cap on a raw score, in ggml's graph order: (tanhf(raw * (1 / cap)))
    * cap, each a float32 op (the C library's tanhf)."""
    return np.tanh(raw * inv_cap) * cap


@njit(inline="always")
def _keys_padded(kbeg, kend, n_tok):
    """The most keys any of the n_tok tokens attends to, rounded up to a multiple of 8 (at least 8)."""
    n_pad = 8
    for t in range(n_tok):
        n_pad = max(n_pad, (kend[t] - kbeg[t] + 7) // 8 * 8)
    return n_pad


@njit(inline="always")
def _lanes_reduce(acc, n_acc):
    """Sum of the n_acc x 8 lanes of acc in ggml's order (vec_dot_f16's reduce for 4
    accumulators; tinyBLAS's / hsum_float_8's for 1)."""
    if n_acc == 4:
        for i in range(8):
            acc[i] = (acc[i] + acc[16 + i]) + (acc[8 + i] + acc[24 + i])
    t0 = acc[0] + acc[4]
    t1 = acc[1] + acc[5]
    t2 = acc[2] + acc[6]
    t3 = acc[3] + acc[7]
    if n_acc == 4:
        return (t0 + t1) + (t2 + t3)
    return (t0 + t2) + (t1 + t3)


def _attend_ggml_rows(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, n_acc, out, z, softcap=F32(0.0)):
    """Attention as `attend` computes it, with every sum in ggml's order: n_acc = 4 for a single
    token (vec_dot_f16), 1 for a batch (tinyBLAS). hd and hd_v must be multiples of 8. Keys a
    query may not see are skipped: their score is -inf and their probability 0 in ggml too, and
    adding a product with 0 leaves an accumulator unchanged. Flat views and unsigned offsets
    let the 8-lane loops vectorize. kc, vc: the cache (n_slots, n_kv, hd); token t attends to the
    keys in slots kmap[kbeg[t]:kend[t]] (in position order; key j of that list is the j-th term of
    its sums); z: a value of the cache's element type, the type q and the probabilities are rounded to;
    softcap > 0: each score is softcap * tanhf(score / softcap) before `scale` (Gemma-2's soft cap, as
    ggml's graph scales, takes tanh and scales back). Decode runs attend_decode, which gives what this gives with n_acc = 4, faster (and this, for a
    single KV head); a batch runs attend_batch, which gives what this gives with n_acc = 1, faster."""
    n_tok, n_head, hd = q.shape
    n_kv = kc.shape[1]
    hdv = vc.shape[2]
    g = n_head // n_kv
    kf = kc.reshape(-1)
    vf = vc.reshape(-1)
    n_pad = _keys_padded(kbeg, kend, n_tok)
    uhd, uhdv, unkv = U(hd), U(hdv), U(n_kv)
    lane_groups = U(n_acc)  # accumulators of 8 lanes: element i goes to group (i / 8) % n_acc
    n_lanes = lane_groups * U(8)
    n_pairs = n_tok * n_head
    n_chunks = min(n_pairs, ATTN_CHUNKS)
    inv_cap = F32(1.0) / softcap if softcap > F32(0.0) else F32(0.0)
    # (token, head) pairs in interleaved chunks (a causal batch's late tokens cost more), with the
    # scratch allocated once per chunk
    for chunk in prange(n_chunks):
        qr = np.empty(hd, F32)
        acc = np.empty(32, F32)
        s = np.empty(n_pad, F32)
        accv = np.empty(n_lanes * uhdv, F32)
        for th in range(chunk, n_pairs, n_chunks):
            t = th // n_head
            h = th - t * n_head
            kh = U(h // g)
            p = pos[t]
            k0 = kbeg[t]
            used = kend[t] - k0
            n_vis = (used + 7) // 8 * 8
            for d in range(hd):
                qr[d] = cache_load(cache_store(q[t, h, d], z))
            m = NEG_INF
            for j in range(used):
                slot = kmap[k0 + j]
                kp = kpos[slot]
                if kp < 0 or kp > p or (window > 0 and p - kp >= window):
                    s[j] = NEG_INF
                    continue
                base = (U(slot) * unkv + kh) * uhd
                if n_acc == 4:
                    v = dot_f16(kf, base, qr, U(0), uhd, 4)
                else:
                    v = dot_f16(kf, base, qr, U(0), uhd, 1)
                v = _soft_cap(v, softcap, inv_cap) * scale if softcap > F32(0.0) else v * scale
                s[j] = v
                if v > m:
                    m = v
            for j in range(used, n_vis):
                s[j] = NEG_INF
            total = 0.0
            for c in range(0, n_vis, 8):
                for i in range(8):
                    e = expf_ggml(s[c + i] - m) if s[c + i] != NEG_INF else F32(0.0)
                    acc[i] = e
                    s[c + i] = e
                total += np.float64(_lanes_reduce(acc, 1))
            inv = F32(1.0 / total)
            accv[:] = 0.0
            for j in range(used):
                if s[j] == F32(0.0):
                    continue
                pj = cache_load(cache_store(s[j] * inv, z))
                axpy_f16(vf, (U(kmap[k0 + j]) * unkv + kh) * uhdv, pj, accv, (U(j) % n_lanes) * uhdv, uhdv)
            ob = U(h) * uhdv
            for d in range(uhdv):
                for li in range(n_lanes):
                    acc[li] = accv[li * uhdv + d]
                out[t, ob + d] = _lanes_reduce(acc, n_acc)


attend_ggml = njit(cache=True, nogil=True, parallel=True)(_attend_ggml_rows)
_attend_ggml = njit(inline="always")(_attend_ggml_rows)  # for attend_decode's one-head items

# A kernel with a parallel loop is never called from another cached kernel as a compiled function
# of its own: when the caller and the callee were compiled in different processes, the caller's
# cached code can name the callee's parallel part under another name, and loading it crashes the
# process (Numba issues 8578 and 10128; here attend_decode compiled by the fused decode step, then
# attend_ggml_decode by an unfused step: the next process segfaulted). Such a kernel's body is an
# inline="always" function, which Numba inlines into each caller (its prange becomes the caller's
# own parallel loop), and the cached kernel is a thin function over it.
# tests/test_ops_cpu.py::test_cached_attention_kernels_load_in_any_compile_order holds it.


# heads of one KV head a decode kernel pass takes together: 4 x 4 accumulators of 8 floats fit in
# 32 vector registers, 2 x 4 in 16
DECODE_HEADS = 4 if REGS32 else 2


@njit(inline="always")
def _scores_pass(kf, kmap, k0, used, k_off, row_stride, qr, q_off, uhd, s, s_off, n_pad, scale, n):
    if n == 4:
        scores_heads4(kf, kmap, k0, used, k_off, row_stride, qr, q_off, uhd, uhd, s, s_off, n_pad, scale)
    elif n == 3:
        scores_heads3(kf, kmap, k0, used, k_off, row_stride, qr, q_off, uhd, uhd, s, s_off, n_pad, scale)
    elif n == 2:
        scores_heads2(kf, kmap, k0, used, k_off, row_stride, qr, q_off, uhd, uhd, s, s_off, n_pad, scale)
    else:
        scores_heads1(kf, kmap, k0, used, k_off, row_stride, qr, q_off, uhd, uhd, s, s_off, n_pad, scale)


@njit(inline="always")
def _pv_pass(vf, kmap, k0, used, v_off, row_stride, e, pp, p_off, n_pad, accv, acc_off, span, uhdv, n):
    # a lane of vec_dot_f16's 32 at a time (pv_lanes: the accumulators stay in registers)
    if n == 4:
        pv_lanes4(vf, kmap, k0, used, v_off, row_stride, e, pp, p_off, n_pad, accv, acc_off, span, uhdv)
    elif n == 3:
        pv_lanes3(vf, kmap, k0, used, v_off, row_stride, e, pp, p_off, n_pad, accv, acc_off, span, uhdv)
    elif n == 2:
        pv_lanes2(vf, kmap, k0, used, v_off, row_stride, e, pp, p_off, n_pad, accv, acc_off, span, uhdv)
    else:
        pv_lanes1(vf, kmap, k0, used, v_off, row_stride, e, pp, p_off, n_pad, accv, acc_off, span, uhdv)


@njit(inline="always")
def attend_decode_inline(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, out, z, softcap=F32(0.0)):
    """attend_ggml with n_acc = 4 (decode tokens: vec_dot_f16's order), the same bits, with the
    heads that share a KV head taken together: each key's and value's row is read and converted
    once for them (attend_ggml reads it once per head, in another thread's chunk: at 2048 keys a
    layer's cache is 4 MiB, larger than a core's L2, so it came from L3 or memory once per head).
    A work item is a token's KV head (all its heads), or part of its heads when that leaves fewer
    than 4 items; one head per item (Gemma-3 270M's 4 heads on one KV head) is attend_ggml's work.
    hd a multiple of 32, hd_v of 8."""
    n_tok, n_head, hd = q.shape
    n_kv = kc.shape[1]
    hdv = vc.shape[2]
    g = n_head // n_kv
    kf = kc.reshape(-1)
    vf = vc.reshape(-1)
    n_pad = _keys_padded(kbeg, kend, n_tok)
    c = g  # heads per item: a divisor of g
    while c > 1 and n_tok * n_kv * (g // c) < 4:
        c -= 1
        while g % c:
            c -= 1
    if c == 1:  # a head per item: attend_ggml's chunks of heads
        _attend_ggml(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, 4, out, z, softcap)
        return
    capped = softcap > F32(0.0)
    inv_cap = F32(1.0) / softcap if capped else F32(0.0)
    per = g // c
    n_items = n_tok * n_kv * per
    uhd, uhdv, unkv = U(hd), U(hdv), U(n_kv)
    n_lanes = U(32)  # vec_dot_f16's 4 accumulators of 8 lanes: key j's product goes to lane j % 32
    span = n_lanes * uhdv  # one head's V accumulators
    for it in prange(n_items):
        t = it // (n_kv * per)
        r = it - t * (n_kv * per)
        kh = r // per
        h0 = kh * g + (r - kh * per) * c
        qr = np.empty(c * hd, F32)
        s = np.empty(c * n_pad, F32)
        m = np.empty(c, F32)
        inv = np.empty(c, F32)
        pp = np.empty(c * n_pad, F32)
        acc = np.empty(32, F32)
        accv = np.zeros(c * span, F32)
        p = pos[t]
        k0 = kbeg[t]
        used = kend[t] - k0
        n_vis = (used + 7) // 8 * 8
        for i in range(c):
            for d in range(hd):
                qr[i * hd + d] = cache_load(cache_store(q[t, h0 + i, d], z))
        # every key's scores (a masked key's too: its slot is in the cache), then the masks, then the
        # maxima over the visible keys (the order of a max does not change it)
        i0 = 0
        while i0 < c:
            nq = min(c - i0, DECODE_HEADS)
            _scores_pass(kf, kmap, U(k0), U(used), U(kh) * uhd, unkv * uhd, qr, U(i0) * uhd, uhd, s,
                         U(i0) * U(n_pad), U(n_pad), F32(1.0) if capped else scale, nq)
            i0 += nq
        if capped:  # the raw scores (times 1.0: unchanged) through the soft cap, then the scale
            for i in range(c):
                for j in range(used):
                    s[i * n_pad + j] = _soft_cap(s[i * n_pad + j], softcap, inv_cap) * scale
        for j in range(used):
            kp = kpos[kmap[k0 + j]]
            if kp < 0 or kp > p or (window > 0 and p - kp >= window):
                for i in range(c):
                    s[i * n_pad + j] = NEG_INF
        for i in range(c):
            mi = NEG_INF
            for j in range(used):
                v = s[i * n_pad + j]
                if v > mi:
                    mi = v
            m[i] = mi
        for i in range(c):
            sb = i * n_pad
            for j in range(used, n_vis):
                s[sb + j] = NEG_INF
            total = 0.0
            mi = m[i]
            exp_shifted(s[sb:sb + n_vis], U(n_vis), mi)  # expf_ggml eight lanes at a time (the same bits)
            for c8 in range(sb, sb + n_vis, 8):
                total += np.float64(_lanes_reduce(s[c8:c8 + 8], 1))  # (n_acc 1 only reads its 8 lanes)
            inv[i] = F32(1.0 / total)
        # the probabilities rounded to the cache's type; the exps (s) say which are skipped
        for i in range(c):
            for j in range(used):
                e = s[i * n_pad + j]
                pp[i * n_pad + j] = cache_load(cache_store(e * inv[i], z)) if e != F32(0.0) else F32(0.0)
        i0 = 0
        while i0 < c:
            nq = min(c - i0, DECODE_HEADS)
            _pv_pass(vf, kmap, U(k0), U(used), U(kh) * uhdv, unkv * uhdv, s, pp, U(i0) * U(n_pad), U(n_pad), accv,
                     U(i0) * span, span, uhdv, nq)
            i0 += nq
        for i in range(c):
            ob = U(h0 + i) * uhdv
            for d in range(uhdv):
                for li in range(n_lanes):
                    acc[li] = accv[U(i) * span + li * uhdv + d]
                out[t, ob + d] = _lanes_reduce(acc, 4)


@njit(cache=True, nogil=True, parallel=True)
def attend_decode(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, out, z, softcap=F32(0.0)):
    """attend_decode_inline: attend_ggml for decode tokens (n_acc = 4), as the fused decode step runs it."""
    attend_decode_inline(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, out, z, softcap)


attend_ggml_decode = attend_decode  # (the unfused step's name for it)


@njit(inline="always")
def _scores_heads(ng, kf, k_off, kstride, qr, q_off, q_stride, s, s_off, s_stride, end4):
    """Scores of keys 0..end4 (a multiple of 4) for ng <= 3 query heads (dot4_heads)."""
    for j0 in range(0, end4, 4):
        ko = U(j0) * kstride + k_off
        so = s_off + U(j0)
        if ng == 3:
            dot4_heads3(kf, ko, kstride, qr, q_off, q_stride, q_stride, s, so, s_stride)
        elif ng == 2:
            dot4_heads2(kf, ko, kstride, qr, q_off, q_stride, q_stride, s, so, s_stride)
        else:
            dot4_heads1(kf, ko, kstride, qr, q_off, q_stride, q_stride, s, so, s_stride)


@njit(cache=True, nogil=True, parallel=True)
def attend_batch(q, kc, vt, kpos, used, pos, window, scale, out, z, softcap=F32(0.0)):
    """What attend_ggml computes for a batch (n_acc = 1, tinyBLAS's order), bit for bit, faster.
    kc: the cache's keys (size, n_kv, hd); vt: its values transposed, (n_kv, hdv, n_pad) with
    n_pad a multiple of 8 >= used and zeros past `used` (as ggml keeps V transposed for this
    product). Per query the loops stop after its last visible key; scores four keys at a time
    for the (up to three) heads sharing a KV head (dot4_heads: each key block loaded and
    converted once for them, their chains interleaved), the exps in one branch-free pass,
    probabilities times V^T four rows at a time (pv_t; a key that is not visible adds 0 * v, as
    in ggml's matrix product)."""
    n_tok, n_head, hd = q.shape
    n_kv = kc.shape[1]
    hdv = vt.shape[1]
    n_pad = vt.shape[2]
    g = n_head // n_kv
    kf = kc.reshape(-1)
    vf = vt.reshape(-1)
    of = out.reshape(-1)
    uhd, uhdv = U(hd), U(hdv)
    kstride = U(n_kv) * uhd
    n_pairs = n_tok * n_kv  # (token, KV head) pairs: the heads sharing a KV head go together
    per = 3 if g % 3 == 0 else (2 if g > 1 else 1)
    n_chunks = min(n_pairs, ATTN_CHUNKS)
    capped = softcap > F32(0.0)
    inv_cap = F32(1.0) / softcap if capped else F32(0.0)
    # per token, once for all its heads: one past its last visible key, and whether every key
    # before that one is visible (a causal batch in a fresh cache: no mask to check per key)
    ends = np.empty(n_tok, np.int64)
    dense = np.empty(n_tok, np.bool_)
    for t in prange(n_tok):
        p = pos[t]
        end = 0
        n_seen = 0
        for j in range(used):
            kp = kpos[j]
            if not (kp < 0 or kp > p or (window > 0 and p - kp >= window)):
                end = j + 1
                n_seen += 1
        ends[t] = end
        dense[t] = n_seen == end
    for chunk in prange(n_chunks):
        qr = np.empty(g * hd, F32)
        sg = np.empty(g * n_pad, F32)
        for tk in range(chunk, n_pairs, n_chunks):
            t = tk // n_kv
            kh = U(tk - t * n_kv)
            p = pos[t]
            h0 = kh * U(g)
            for i in range(g):
                for d in range(hd):
                    qr[i * hd + d] = cache_load(cache_store(q[t, h0 + U(i), d], z))
            end = ends[t]
            n_vis = (end + 7) // 8 * 8
            end4 = end - end % 4
            # the scores of the KV head's g query heads, `per` heads per pass over the keys (4 per
            # head accumulators + the queries + a key stay within AVX2's 16 registers up to 3)
            for i0 in range(0, g, per):
                _scores_heads(min(per, g - i0), kf, kh * uhd, kstride, qr, U(i0) * uhd, uhd, sg,
                              U(i0) * U(n_pad), U(n_pad), end4)
            for i in range(g):
                for j in range(end4, end):
                    sg[i * n_pad + j] = dot_f16(kf, U(j) * kstride + kh * uhd, qr, U(i) * uhd, uhd, 1)
            visible = dense[t]
            for i in range(g):
                h = h0 + U(i)
                s = sg[i * n_pad:(i + 1) * n_pad]
                m = NEG_INF
                for j in range(end):
                    kp = kpos[j]
                    if not visible and (kp < 0 or kp > p or (window > 0 and p - kp >= window)):
                        s[j] = NEG_INF
                    else:
                        v = _soft_cap(s[j], softcap, inv_cap) * scale if capped else s[j] * scale
                        s[j] = v
                        if v > m:
                            m = v
                for j in range(end, n_vis):
                    s[j] = NEG_INF
                exp_shifted(s, U(n_vis), m)  # -inf (not visible) -> 0
                total = 0.0
                for c in range(0, n_vis, 8):
                    t0 = s[c] + s[c + 4]
                    t1 = s[c + 1] + s[c + 5]
                    t2 = s[c + 2] + s[c + 6]
                    t3 = s[c + 3] + s[c + 7]
                    total += np.float64((t0 + t2) + (t1 + t3))
                inv = F32(1.0 / total)
                for j in range(n_vis):
                    s[j] = cache_load(cache_store(s[j] * inv, z))
                pv_t(vf, kh * uhdv * U(n_pad), U(n_pad), s, U(n_vis), uhdv, of, (U(t) * U(n_head) + h) * uhdv)
