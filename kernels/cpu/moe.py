"""Mixture-of-experts routing as llama.cpp's CPU computes it (build_moe_ffn): the F32 router
product, the softmax over experts, the top-k choice and the renormalised weights.

The router is an F32 matrix: llama.cpp takes it through ggml_vec_dot_f32 for one token and through
tinyBLAS for a batch (rows a multiple of 8), two different sum orders, so a batch's logits are not a
token's alone (a one-ulp logit can change the chosen experts). Each kernel has its NumPy twin
(`*_ref`), held together in tests/test_moe.py.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.vecmath import expf_ggml
from edgellm.kernels.cpu.ir.kquants import rowdot_q6_k
from edgellm.kernels.cpu.ir.packed import il8_q4_k
from numba import njit, prange

F32 = np.float32
CLAMP_MIN = F32(6.103515625e-5)  # the renormalising sum is clamped to 2^-14 (llama-graph's build_moe_ffn)


@njit(cache=True, inline="always")
def _dot_vec(w, x):
    """ggml_vec_dot_f32 (AVX2): four 8-lane fma accumulators over steps of 32, reduced as
    a0 + a2, a1 + a3, then those, then lanes ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7)); the tail by fma."""
    n = x.shape[0]
    nb = n & ~31
    acc = np.zeros(32, np.float32)
    for i in range(0, nb, 32):
        for j in range(32):
            acc[j] = fma32(w[i + j], x[i + j], acc[j])
    t = np.empty(8, np.float32)
    for j in range(8):
        t[j] = (acc[j] + acc[16 + j]) + (acc[8 + j] + acc[24 + j])
    s = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]))
    for i in range(nb, n):
        s = fma32(w[i], x[i], s)
    return s


@njit(cache=True, inline="always")
def _dot_tiny(w, x):
    """tinyBLAS's F32 element (n a multiple of 8): one 8-lane fma accumulator over steps of 8,
    reduced as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    acc = np.zeros(8, np.float32)
    for i in range(0, x.shape[0], 8):
        for j in range(8):
            acc[j] = fma32(w[i + j], x[i + j], acc[j])
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))


@njit(cache=True, parallel=True)
def _router(w, x, out, tiny):
    for t in range(x.shape[0]):
        for e in prange(w.shape[0]):
            out[t, e] = _dot_tiny(w[e], x[t]) if tiny else _dot_vec(w[e], x[t])


def router_logits(w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out (n_tok, n_expert) = x (n_tok, n_embd) @ w (n_expert, n_embd).T in llama.cpp's order for
    this many tokens."""
    _router(w, x, out, x.shape[0] >= 2 and x.shape[1] % 8 == 0)


def router_logits_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """NumPy twin of router_logits (fma as a float64 product and sum rounded once)."""
    n_tok, n = x.shape
    out = np.empty((n_tok, w.shape[0]), F32)
    fma = lambda a, b, c: (a.astype(np.float64) * b + c).astype(F32)
    for t in range(n_tok):
        xt = x[t]
        if n_tok >= 2 and n % 8 == 0:
            acc = np.zeros((w.shape[0], 8), F32)
            for i in range(0, n, 8):
                acc = fma(w[:, i:i + 8], xt[i:i + 8], acc)
            out[t] = ((acc[:, 0] + acc[:, 4]) + (acc[:, 2] + acc[:, 6])) + ((acc[:, 1] + acc[:, 5])
                                                                             + (acc[:, 3] + acc[:, 7]))
            continue
        nb = n & ~31
        acc = np.zeros((w.shape[0], 32), F32)
        for i in range(0, nb, 32):
            acc = fma(w[:, i:i + 32], xt[i:i + 32], acc)
        t8 = (acc[:, :8] + acc[:, 16:24]) + (acc[:, 8:16] + acc[:, 24:])
        s = ((t8[:, 0] + t8[:, 4]) + (t8[:, 1] + t8[:, 5])) + ((t8[:, 2] + t8[:, 6]) + (t8[:, 3] + t8[:, 7]))
        for i in range(nb, n):
            s = fma(w[:, i], xt[i], s)
        out[t] = s
    return out


def expert_probs(logits: np.ndarray) -> np.ndarray:
    """float32 softmax of each row as ggml_compute_forward_soft_max_f32 makes it: ggml's vector exp
    of (x - max) eight lanes at a time, each group's sum ((e0+e4)+(e2+e6)) + ((e1+e5)+(e3+e7)) added
    into a float64 total, the C library's expf for the n % 8 tail, then each value times
    (float)(1 / total)."""
    from edgellm.kernels.cpu.numpy_backend import expf_ggml
    from edgellm.kernels.cpu.reference import c_expf

    n_tok, n = logits.shape
    m = logits.max(axis=1, keepdims=True)
    nb = n & ~7
    e = np.empty_like(logits)
    e[:, :nb] = expf_ggml(logits[:, :nb] - m)
    g = e[:, :nb].reshape(n_tok, -1, 8)
    sums = ((g[..., 0] + g[..., 4]) + (g[..., 2] + g[..., 6])) + ((g[..., 1] + g[..., 5]) + (g[..., 3] + g[..., 7]))
    total = np.zeros(n_tok, np.float64)
    for j in range(sums.shape[1]):  # float64 adds in group order
        total += sums[:, j]
    if nb < n:
        expf = c_expf()
        for t in range(n_tok):
            for i in range(nb, n):
                e[t, i] = expf(logits[t, i] - m[t, 0])
                total[t] += float(e[t, i])
    return e * (1.0 / total).astype(F32)[:, None]


def route(probs: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """(experts int64 (n_tok, k), weights float32 (n_tok, k)): the k most probable experts of each
    token, most probable first (ties: the lower index first, as libstdc++'s sort of up to 16
    experts leaves them), and their probabilities; with `norm` divided by their sum (float64 in
    slot order, rounded, clamped below at 2^-14)."""
    ids = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, ids, axis=1)
    if norm:
        s = np.zeros(w.shape[0], np.float64)
        for j in range(k):
            s += w[:, j]
        w = w / np.maximum(s.astype(F32), CLAMP_MIN)[:, None]
    return ids, w.astype(F32)


@njit(cache=True)
def _route(logits, k, norm, ids, weights):
    n_tok, n = logits.shape
    nb = n & ~7
    e = np.empty(n, np.float32)
    taken = np.empty(n, np.bool_)
    for t in range(n_tok):
        x = logits[t]
        m = x[0]
        for i in range(1, n):
            m = max(m, x[i])
        total = 0.0  # float64, as ggml_float
        for g in range(0, nb, 8):
            for i in range(8):
                e[g + i] = expf_ggml(x[g + i] - m)
            total += ((e[g] + e[g + 4]) + (e[g + 2] + e[g + 6])) + ((e[g + 1] + e[g + 5]) + (e[g + 3] + e[g + 7]))
        for i in range(nb, n):
            e[i] = np.float32(math.exp(x[i] - m))  # the C library's expf
            total += e[i]
        scale = np.float32(1.0 / total)
        for i in range(n):
            e[i] *= scale
            taken[i] = False
        s = 0.0
        for j in range(k):  # the most probable left, the lower index on a tie
            best = -1
            for i in range(n):
                if not taken[i] and (best < 0 or e[i] > e[best]):
                    best = i
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = e[best]
            s += e[best]
        if norm:
            d = max(np.float32(s), np.float32(6.103515625e-5))
            for j in range(k):
                weights[t, j] = weights[t, j] / d


def route_logits(logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """route(expert_probs(logits), k, norm) in one Numba call (the same bits)."""
    ids = np.empty((logits.shape[0], k), np.int64)
    weights = np.empty((logits.shape[0], k), F32)
    _route(np.ascontiguousarray(logits, dtype=F32), k, norm, ids, weights)
    return ids, weights


def silu_scalar(x: np.ndarray) -> np.ndarray:
    """float32 x / (1 + expf(-x)) with the C library's expf: ggml's silu of rows shorter than 8 (the
    scalar tail), as qwen2moe's shared-expert gate takes it."""
    expf = _c_expf()
    flat = np.asarray(x, F32).reshape(-1)
    out = np.array([v / (F32(1.0) + expf(-v)) for v in flat], dtype=F32)
    return out.reshape(np.shape(x))


# --- one token through the chosen experts (Q4_K rows packed by eight, all experts in one array) --------
@njit(cache=True, parallel=True)
def decode_gate_up_q4k8(gp, upk, ids, xq, xd, xs, nb, rows, gate, up):
    """gate[j], up[j] (float32 (k * rows,) flat) = expert ids[j]'s gate and up rows times the token
    (Q8_K parts xq, xd, xs of nb super-blocks), each row group as matvec_q4_k8 computes it; gp and
    upk hold every expert's packed rows, expert e's from row e * rows on."""
    k = ids.shape[0]
    g8 = rows // 8
    rb = np.uint64(gp.shape[1])
    for task in prange(2 * k * g8):
        j = (task // g8) % k
        g = task % g8
        w_off = np.uint64(ids[j] * rows + 8 * g) * rb
        o_off = np.uint64(j * rows + 8 * g)
        if task < k * g8:
            il8_q4_k(gp, w_off, xq, xd, xs, np.uint64(0), np.uint64(nb), gate, o_off)
        else:
            il8_q4_k(upk, w_off, xq, xd, xs, np.uint64(0), np.uint64(nb), up, o_off)


@njit(cache=True, parallel=True)
def decode_down_q4k8(dp, ids, xq, xd, xs, nb, rows, out):
    """out[j] (float32 (k * rows,) flat) = expert ids[j]'s down rows times activation row j (Q8_K
    parts of k rows end to end, nb super-blocks each)."""
    k = ids.shape[0]
    g8 = rows // 8
    rb = np.uint64(dp.shape[1])
    for task in prange(k * g8):
        j = task // g8
        g = task % g8
        il8_q4_k(dp, np.uint64(ids[j] * rows + 8 * g) * rb, xq, xd, xs, np.uint64(j * nb), np.uint64(nb), out,
                 np.uint64(j * rows + 8 * g))


@njit(cache=True, parallel=True)
def decode_down_q6k(dw, ids, xq, xd, xs, nb, rows, out):
    """out[j] (float32 (k * rows,) flat) = expert ids[j]'s Q6_K down rows (every expert's rows in
    dw, expert e's from row e * rows on) times activation row j, each row as matvec_q6_k does it."""
    k = ids.shape[0]
    n16 = (rows + 15) // 16
    rb = np.uint64(dw.shape[1])
    for task in prange(k * n16):
        j = task // n16
        c = task % n16
        for r in range(c * 16, min(c * 16 + 16, rows)):
            out[j * rows + r] = rowdot_q6_k(dw, np.uint64(ids[j] * rows + r) * rb, xq, np.uint64(j * nb * 256), xd,
                                            xs, np.uint64(j * nb), np.uint64(nb))


@functools.cache
def _c_expf():
    """The C library's expf, found once (finding the library runs ldconfig: milliseconds)."""
    from edgellm.kernels.cpu.reference import c_expf

    return c_expf()
