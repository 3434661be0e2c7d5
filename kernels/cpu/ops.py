"""Numba kernels for the elementwise ops of a transformer block on the CPU: norms, RoPE, activations,
the q/k/v preparation and the cache conversions (the quantized products live in the type families,
attention in attention.py and flash.py). Each has a NumPy twin in `numpy_backend.NumpyBackend`,
and tests/test_ops_cpu.py holds them together.

Float16 KV cache: Numba has no float16 type, so the cache is passed as its uint16 bits and converted
one element at a time by LLVM's half <-> float instructions (`ir.attention.cache_load`, `cache_store`); with F16C (x86) or
on ARM these vectorize, so attention reads the f16 cache directly without a float32 copy. Where the
CPU has no half conversion instructions `host.F16C` is False and the backend uses the twins.

The numbers follow ggml's CPU ops as the twins do: RMSNorm sums f32 squares in float64 and scales
in float32; RoPE reads precomputed cos/sin tables; attention rounds q to the cache type, softmax is
float32 with the max subtracted, probabilities normalized before the V sum.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from edgellm.kernels.cpu.common import U
from edgellm.kernels.cpu.ir.attention import cache_load, cache_store
from edgellm.kernels.cpu.ir.builder import fma32
from edgellm.kernels.cpu.ir.vecmath import silu_mul_v8

F32 = np.float32


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
    return table[U(cache_store(g, np.uint16(0)))]


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
                kc[slot, h, d] = cache_store(k[t, h, d], z)
            for d in range(hdv):
                vc[slot, h, d] = cache_store(v[t, h, d], z)


# --- attention -----------------------------------------------------------------------------
@njit(cache=True, nogil=True, parallel=True)
def cache_to_f32(c, out):
    """out float32 (used, n_kv, hd) = cache slots [0, used) of c (size, n_kv, hd) (exact)."""
    used, n_kv, hd = out.shape
    for j in prange(used):
        for h in range(n_kv):
            for d in range(hd):
                out[j, h, d] = cache_load(c[j, h, d])


@njit(cache=True, nogil=True)
def round_to_cache(q, cache, out):
    """out float32 = q rounded to the element type of the cache (f16 bits: nearest even)."""
    z = cache[0, 0, 0]
    qf = q.reshape(-1)
    of = out.reshape(-1)
    for i in range(qf.shape[0]):
        of[i] = cache_load(cache_store(qf[i], z))


@njit(cache=True, nogil=True)
def soft_cap(x, cap):
    """In place on float32 x (flat): cap * tanhf(x / cap) as ggml_scale, ggml_tanh, ggml_scale
    compute it (Gemma-2's final logits)."""
    inv = F32(1.0) / cap
    for i in range(x.shape[0]):
        x[i] = np.tanh(x[i] * inv) * cap
