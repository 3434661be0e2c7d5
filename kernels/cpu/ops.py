"""Numba kernels for the non-matmul ops of a transformer block on the CPU (the quantized products
live in the type families). Each has a NumPy twin in `edgellm.kernels.cpu.backend.NumpyBackend`, and
tests/test_ops_cpu.py holds them together.

Float16 KV cache: Numba has no float16 type, so the cache is passed as its uint16 bits and converted
one element at a time by LLVM's half <-> float instructions (`_load`, `_store`); with F16C (x86) or
on ARM these vectorize, so attention reads the f16 cache directly without a float32 copy. Where the
CPU has no half conversion instructions `F16_NATIVE` is False and the backend uses the twins.

The numbers follow ggml's CPU ops as the twins do: RMSNorm sums f32 squares in float64 and scales
in float32; RoPE reads precomputed cos/sin tables; attention rounds q to the cache type, softmax is
float32 with the max subtracted, probabilities normalized before the V sum.
"""
from __future__ import annotations

import os

if "NUMBA_CACHE_DIR" not in os.environ:  # compiled kernels go to edgellm's user cache dir
    from edgellm.kernels.cpu import numba_cache_dir

    os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import binding as llvm_binding  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgellm.kernels.cpu.common import REGS32, U, exp_shifted, expf_ggml, fma32, silu_mul_v8  # noqa: E402
from edgellm.kernels.cpu.rowdot import (axpy_f16, dot4_heads1, dot4_heads2, dot4_heads3, dot_f16,  # noqa: E402
                                        pv_lanes1, pv_lanes2, pv_lanes3, pv_lanes4, pv_t, scores_heads1,
                                        scores_heads2, scores_heads3, scores_heads4)

numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]

F32 = np.float32
NEG_INF = F32(-np.inf)
ATTN_CHUNKS = 64  # attend_ggml: parallel chunks of (token, head) pairs (scratch allocated per chunk)


def _f16_native() -> bool:
    arch = llvm_binding.get_process_triple().split("-")[0]
    if arch not in ("x86_64", "i386", "i686"):
        return True  # AArch64 and others convert half natively
    feats = llvm_binding.get_host_cpu_features().flatten().split(",")
    return "+f16c" in feats


F16_NATIVE = _f16_native()


@intrinsic
def _load(typingctx, x):
    """float32 of a cache element: uint16 (float16 bits) or float32."""
    if x == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen
    if x == types.float32:
        def ident(context, builder, sig, args):
            return args[0]
        return types.float32(types.float32), ident
    return None


@intrinsic
def _store(typingctx, x, like):
    """float32 x as a cache element of like's type: float16 bits (round to nearest even) or float32."""
    if like == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32, types.uint16), codegen
    if like == types.float32:
        def ident(context, builder, sig, args):
            return args[0]
        return types.float32(types.float32, types.float32), ident
    return None


# --- elementwise ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def rms_norm(x, w, eps, out):
    """x, out float32 (rows, n) (may alias); w (n,) or (0,) for none. Per row:
    mean = f32(sum_f64(x*x) / n), out = x * (1 / sqrt(mean + eps)) [* w]."""
    rows, n = x.shape
    has_w = w.shape[0] == n
    for r in range(rows):
        s = 0.0
        for i in range(n):
            v = x[r, i]
            s += np.float64(v * v)
        mean = F32(s / n)
        scale = F32(1.0) / np.sqrt(mean + F32(eps))
        for i in range(n):
            y = x[r, i] * scale
            out[r, i] = y * w[i] if has_w else y


@njit(cache=True, nogil=True)
def add_rms_norm(x, o, post_w, next_w, eps, h):
    """Residual step: o = rms_norm(o) * post_w (if post_w is not empty); x += o; then
    h = rms_norm(x) * next_w (if next_w is not empty). x, o, h float32 (rows, n)."""
    if post_w.shape[0]:
        rms_norm(o, post_w, eps, o)
    rows, n = x.shape
    for r in range(rows):
        for i in range(n):
            x[r, i] = x[r, i] + o[r, i]
    if next_w.shape[0]:
        rms_norm(x, next_w, eps, h)


@njit(cache=True, nogil=True, parallel=True)
def silu_mul(gate, up, out):
    """out = gate / (1 + exp(-gate)) * up, float32 (rows, n), as ggml's swiglu: ggml's vectorized
    exp for each full group of 8 of a row, the C library's expf for the rest. Rows in parallel."""
    rows, n = gate.shape
    n8 = n // 8 * 8
    gf, uf, of = gate.reshape(-1), up.reshape(-1), out.reshape(-1)
    for r in prange(rows):
        silu_mul_v8(gf, uf, of, U(r) * U(n), U(n8))
        for i in range(n8, n):
            g = gate[r, i]
            out[r, i] = g / (F32(1.0) + np.exp(-g)) * up[r, i]


@njit(inline="always")
def gelu_ggml(g, table):
    """ggml's GELU of one float32: the f16 GELU table at g rounded to f16 for -10 < g < 10, 0 below,
    g itself above."""
    if g <= F32(-10.0):
        return F32(0.0)
    if g >= F32(10.0):
        return g
    return table[U(_store(g, np.uint16(0)))]


@njit(cache=True, nogil=True, parallel=True)
def gelu_mul(gate, up, table, out):
    """out = gelu(gate) * up, float32 (rows, n), as ggml's GEGLU: the f16 GELU table at gate
    rounded to f16 for -10 < gate < 10, 0 below, gate itself above. Rows in parallel."""
    rows, n = gate.shape
    for r in prange(rows):
        for i in range(n):
            out[r, i] = gelu_ggml(gate[r, i], table) * up[r, i]


@njit(cache=True, nogil=True)
def rope(x, cos, sin, pos, n_rot, neox):
    """In place on x float32 (n_tok, n_head, hd); cos, sin float32 (n_pos, n_rot/2) tables indexed
    by position. neox pairs (i, i + n_rot/2), else (2i, 2i + 1). Each pair rotates as ggml's
    compiled code does it: fma(x0, cos, -(x1 sin)), fma(x0, sin, x1 cos)."""
    n_tok, n_head, _ = x.shape
    half = n_rot // 2
    for t in range(n_tok):
        p = pos[t]
        for h in range(n_head):
            for i in range(half):
                c = cos[p, i]
                s = sin[p, i]
                i0 = i if neox else 2 * i
                i1 = i + half if neox else 2 * i + 1
                x0 = x[t, h, i0]
                x1 = x[t, h, i1]
                x[t, h, i0] = fma32(x0, c, -(x1 * s))
                x[t, h, i1] = fma32(x0, s, x1 * c)


_SQRT_2_OVER_PI = F32(0.7978845608028654)
_GELU_COEF_A = F32(0.044715)


@njit(cache=True, nogil=True)
def gelu_table(x):
    """In place on float32 x: GELU-tanh as ggml's compiled ggml_gelu_f32 computes it,
    0.5 x (1 + tanhf(sqrt(2/pi) x fma(0.044715 x, x, 1))), with the C library's tanhf (the
    table llama.cpp's GEGLU reads is this, rounded to f16)."""
    for i in range(x.shape[0]):
        v = x[i]
        inner = (_SQRT_2_OVER_PI * v) * fma32(_GELU_COEF_A * v, v, F32(1.0))
        x[i] = F32(0.5) * v * (F32(1.0) + np.tanh(inner))


@njit(cache=True, nogil=True)
def cos_sin(theta, cos, sin):
    """cos, sin of float32 theta with the C library's cosf / sinf (what ggml's rope cache calls)."""
    for i in range(theta.shape[0]):
        for j in range(theta.shape[1]):
            cos[i, j] = np.cos(theta[i, j])
            sin[i, j] = np.sin(theta[i, j])


@njit(cache=True, nogil=True)
def prepare_qkv(q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, pos, n_rot, neox, kc, vc, kpos, slots, q_scale):
    """Everything between the q/k/v projections and attention, in place on q (n_tok, n_head, hd),
    k (n_tok, n_kv, hd), v (n_tok, n_kv, hd_v): + biases, QK-norm per head, RoPE, q * q_scale
    (float32; 1: none); then k, v into the cache kc, vc (n_slots, n_kv, hd) at slots[t],
    kpos[slot] = pos. Empty arrays skip a step."""
    n_tok, n_head, hd = q.shape
    n_kv = k.shape[1]
    hdv = v.shape[2]
    for t in range(n_tok):
        if bq.shape[0]:
            for h in range(n_head):
                for d in range(hd):
                    q[t, h, d] += bq[h * hd + d]
        if bk.shape[0]:
            for h in range(n_kv):
                for d in range(hd):
                    k[t, h, d] += bk[h * hd + d]
        if bv.shape[0]:
            for h in range(n_kv):
                for d in range(hdv):
                    v[t, h, d] += bv[h * hdv + d]
    if q_norm.shape[0]:
        q2 = q.reshape(n_tok * n_head, hd)
        rms_norm(q2, q_norm, eps, q2)
    if k_norm.shape[0]:
        k2 = k.reshape(n_tok * n_kv, hd)
        rms_norm(k2, k_norm, eps, k2)
    rope(q, cos, sin, pos, n_rot, neox)
    rope(k, cos, sin, pos, n_rot, neox)
    if q_scale != F32(1.0):
        for t in range(n_tok):
            for h in range(n_head):
                for d in range(hd):
                    q[t, h, d] *= q_scale
    z = kc[0, 0, 0]
    for t in range(n_tok):
        slot = slots[t]
        kpos[slot] = pos[t]
        for h in range(n_kv):
            for d in range(hd):
                kc[slot, h, d] = _store(k[t, h, d], z)
            for d in range(hdv):
                vc[slot, h, d] = _store(v[t, h, d], z)


# --- attention -----------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def cache_to_f32(c, out):
    """out float32 (used, n_kv, hd) = cache slots [0, used) of c (size, n_kv, hd) (exact)."""
    used, n_kv, hd = out.shape
    for j in prange(used):
        for h in range(n_kv):
            for d in range(hd):
                out[j, h, d] = _load(c[j, h, d])


@njit(cache=True, nogil=True)
def round_to_cache(q, cache, out):
    """out float32 = q rounded to the element type of the cache (f16 bits: nearest even)."""
    z = cache[0, 0, 0]
    qf = q.reshape(-1)
    of = out.reshape(-1)
    for i in range(qf.shape[0]):
        of[i] = _load(_store(qf[i], z))


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


@njit(cache=True, nogil=True)
def soft_cap(x, cap):
    """In place on float32 x (flat): cap * tanhf(x / cap) as ggml_scale, ggml_tanh, ggml_scale
    compute it (Gemma-2's final logits)."""
    inv = F32(1.0) / cap
    for i in range(x.shape[0]):
        x[i] = np.tanh(x[i] * inv) * cap


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
                qr[d] = _load(_store(q[t, h, d], z))
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
                pj = _load(_store(s[j] * inv, z))
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
def _attend_decode(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, out, z, softcap=F32(0.0)):
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
                qr[i * hd + d] = _load(_store(q[t, h0 + i, d], z))
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
                pp[i * n_pad + j] = _load(_store(e * inv[i], z)) if e != F32(0.0) else F32(0.0)
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
    """_attend_decode: attend_ggml for decode tokens (n_acc = 4), as the fused decode step runs it."""
    _attend_decode(q, kc, vc, kpos, kmap, kbeg, kend, pos, window, scale, out, z, softcap)


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
                    qr[i * hd + d] = _load(_store(q[t, h0 + U(i), d], z))
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
                    s[j] = _load(_store(s[j] * inv, z))
                pv_t(vf, kh * uhdv * U(n_pad), U(n_pad), s, U(n_vis), uhdv, of, (U(t) * U(n_head) + h) * uhdv)


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
    return _load(np.uint16(np.uint16(row[o]) | (np.uint16(row[o + 1]) << np.uint16(8))))


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
                vkq[d] = _load(_store(vkq[d] * ms, z))
        else:
            vs = np.exp(F32(s - m))
        vo = slot * vstride + row_v
        for d in range(hdv):
            vkq[d] = _load(_store(fma32(_load(vf[vo + d]), vs, vkq[d]), z))
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
            qr[d] = _load(_store(q[t, h, d], z))
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
                    kt[d, n] = _load(kf[ko + d])
                vo = slot * vstride + kh * hdv
                for d in range(hdv):
                    vt[n, d] = _load(vf[vo + d])
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
