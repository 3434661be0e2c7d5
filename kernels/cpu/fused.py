"""One decode step of a transformer block in a single Numba call.

A token's block is ~15 small kernels; called one by one from Python each costs a few microseconds
of dispatch plus a parallel-region launch (~5 us with two threads, measured), which for SmolLM2
(30 blocks, 0.5-2 MB of weights each) was a third of the decode step. Here the block runs as one
call with five parallel regions: the q/k/v rows together, attention, the output projection, the
gate/up rows together, the down projection. The arithmetic is the unfused kernels' own (the same
row dot products in ggml's order, the same norm / RoPE / attention / activation code), so the
results are identical bit for bit (tests/test_models.py holds them together).

Weights must be of a type with a row kernel here (`ROW_TYPES`); CPUBackend runs other layers
through the unfused ops.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, U, njit, prange, quantize_q8_32, quantize_q8_k
from edgellm.kernels.cpu.kquants import _row_q4_k
from edgellm.kernels.cpu.ops import _store, add_rms_norm, attend_ggml, expf_ggml, prepare_qkv, rms_norm
from edgellm.kernels.cpu.legacy import _row_q4_0
from edgellm.kernels.cpu.rowdot import rowdot1_q5_1, rowdot_q4_1, rowdot_q5_0, rowdot_q5_k, rowdot_q6_k, rowdot_q8_0

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = (int(t) for t in (
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
    GGMLType.Q6_K))
ROW_TYPES = frozenset((Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K))


@njit(inline="always")
def _is_k(tid):
    """The type takes its activations in Q8_K form (the others: Q8_0 / Q8_1, "q8_32")."""
    return tid == Q4_K or tid == Q5_K or tid == Q6_K


@njit(inline="always")
def _row(tid, w, r, a32, ak, n_in):
    """Row r of weight matrix w (type id tid) times x of n_in values, given in both activation
    forms (buffers at least that long)."""
    rb = U(w.shape[1])
    if tid == Q4_1:
        return rowdot_q4_1(w, U(r) * rb, a32[0], U(0), a32[1], a32[3], U(0), U(n_in // 32))
    if tid == Q5_0:
        return rowdot_q5_0(w, U(r) * rb, a32[0], U(0), a32[1], U(0), U(n_in // 32))
    if tid == Q8_0:
        return rowdot_q8_0(w, U(r) * rb, a32[0], U(0), a32[1], U(0), U(n_in // 32))
    if tid == Q4_0:
        return _row_q4_0(w[r], a32[0], a32[1], a32[2], U(0), U(n_in // 32))
    if tid == Q5_1:
        return rowdot1_q5_1(w, U(r) * rb, a32[0], U(0), U(0), a32[1], a32[3], U(0), U(0), U(n_in // 32))
    if tid == Q5_K:
        return rowdot_q5_k(w, U(r) * rb, ak[0], U(0), ak[1], ak[2], U(0), U(n_in // 256))
    if tid == Q6_K:
        return rowdot_q6_k(w, U(r) * rb, ak[0], U(0), ak[1], ak[2], U(0), U(n_in // 256))
    return _row_q4_k(w[r], ak[0], ak[1], ak[2], U(0), U(n_in // 256), False)


@njit(cache=True, nogil=True)
def _quantize(x, a32, ak, need32, needk):
    """x into the activation buffers (their first len(x) values / blocks)."""
    n = x.size
    if need32:
        quantize_q8_32(x, a32[0][:n], a32[1][:n // 32], a32[2][:n // 32], a32[3][:n // 32])
    if needk:
        quantize_q8_k(x, ak[0][:n], ak[1][:n // 256], ak[2][:n // 16], ak[3])


@njit(cache=True, nogil=True, parallel=True)
def decode_block(x, h, q, k, v, att, o, gate, up, a32, ak,
                 attn_norm, post_attn_norm, ffn_norm, post_ffw_norm, q_norm, k_norm, bq, bk, bv,
                 wq, wk, wv, wo, wg, wu, wd, tids,
                 eps, cos, sin, pos, n_rot, neox, kc, vc, kpos, size, used, window, scale,
                 gelu, gelu_table):
    """One token through one block, in place on x (1, n_embd). q (1, n_head, hd), k / v
    (1, n_kv, hd), att (1, n_head * hd_v), o / h (1, n_embd), gate / up (1, n_ff): scratch.
    a32 / ak: activation buffers (q8_32 and q8_k parts) for the widest input. tids: the types of
    wq, wk, wv, wo, wg, wu, wd. Norms and biases of size 0 are absent. Returns nothing."""
    n_embd = x.shape[1]
    # attention: norm, q/k/v rows in one parallel loop
    rms_norm(x, attn_norm, eps, h)
    need32 = not (_is_k(tids[0]) and _is_k(tids[1]) and _is_k(tids[2]))
    needk = _is_k(tids[0]) or _is_k(tids[1]) or _is_k(tids[2])
    _quantize(h[0], a32, ak, need32, needk)
    n_in_qkv = n_embd
    qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
    nq, nk, nv = wq.shape[0], wk.shape[0], wv.shape[0]
    for r in prange(nq + nk + nv):
        if r < nq:
            qf[r] = _row(tids[0], wq, r, a32, ak, n_in_qkv)
        elif r < nq + nk:
            kf[r - nq] = _row(tids[1], wk, r - nq, a32, ak, n_in_qkv)
        else:
            vf[r - nq - nk] = _row(tids[2], wv, r - nq - nk, a32, ak, n_in_qkv)
    prepare_qkv(q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, pos, n_rot, neox, kc, vc, kpos, size)
    attend_ggml(q, kc, vc, kpos, used, pos, window, scale, 4, att)
    # output projection, residual, ffn norm
    n_att = att.shape[1]
    _quantize(att[0], a32, ak, not _is_k(tids[3]), _is_k(tids[3]))
    n_in_o = n_att
    of = o.reshape(-1)
    for r in prange(wo.shape[0]):
        of[r] = _row(tids[3], wo, r, a32, ak, n_in_o)
    add_rms_norm(x, o, post_attn_norm, ffn_norm, eps, h)
    # gated FFN
    need32 = not (_is_k(tids[4]) and _is_k(tids[5]))
    needk = _is_k(tids[4]) or _is_k(tids[5])
    _quantize(h[0], a32, ak, need32, needk)
    n_in_ffn = n_embd
    gf, uf = gate.reshape(-1), up.reshape(-1)
    ng, nu = wg.shape[0], wu.shape[0]
    for r in prange(ng + nu):
        if r < ng:
            gf[r] = _row(tids[4], wg, r, a32, ak, n_in_ffn)
        else:
            uf[r - ng] = _row(tids[5], wu, r - ng, a32, ak, n_in_ffn)
    n_ff = gf.size
    n8 = n_ff // 8 * 8
    for i in range(n_ff):
        g = gf[i]
        if gelu:  # ggml's GEGLU: f16 table lookup within (-10, 10)
            if g <= F32(-10.0):
                y = F32(0.0)
            elif g >= F32(10.0):
                y = g
            else:
                y = gelu_table[U(_store(g, np.uint16(0)))]
            gf[i] = y * uf[i]
        else:
            e = expf_ggml(-g) if i < n8 else np.exp(-g)
            gf[i] = g / (F32(1.0) + e) * uf[i]
    _quantize(gf, a32, ak, not _is_k(tids[6]), _is_k(tids[6]))
    n_in_down = n_ff
    for r in prange(wd.shape[0]):
        of[r] = _row(tids[6], wd, r, a32, ak, n_in_down)
    add_rms_norm(x, o, post_ffw_norm, post_ffw_norm[:0], eps, x)

