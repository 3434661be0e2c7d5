"""Numba encoders of the legacy block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): ggml's quantize_row_*_ref.

The slow, readable twins are gguf's `quants.quantize` (tested bit-exact against ggml by the gguf
package, and here against llama.cpp's bytes). Same float32 operations in the same order, no fast-math;
ggml's conversions: `(int8_t)(v + 0.5f)` truncates toward zero, Q8_0's `roundf` rounds half away from
zero, the scales are stored as f16 rounded to nearest even. Every block of 32 weights is independent:
Gemma-3's tied 262144 x 640 embedding is Q8_0 in the K-quant mixes (640 does not split into 256-weight
super-blocks), so this is most of a Q4_K_M run.

Every entry point: x float32 (n_blocks, 32) C-contiguous, out uint8 (n_blocks, type_size).
"""
from __future__ import annotations

import numpy as np

from edgellm.kernels import cpu as _cpu

_cpu.use_cache_dir()  # before the cache=True functions below are defined

from edgellm.kernels.cpu.common import f32_to_f16_bits, njit  # noqa: E402
from edgellm.quality.kquant_numba import block_quantizer  # noqa: E402

F = np.float32
JIT = dict(cache=True, nogil=True)
QK = 32


@njit(inline="always")
def put_f16(o, at, v):
    h = f32_to_f16_bits(v)
    o[at] = np.uint8(h & 0xFF)
    o[at + 1] = np.uint8(h >> 8)


@njit(inline="always")
def abs_max_signed(x):
    """The first value of largest magnitude (ggml: `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`)."""
    amax = F(0)
    vmax = F(0)
    for j in range(QK):
        a = abs(x[j])
        if amax < a:
            amax = a
            vmax = x[j]
    return vmax


@njit(inline="always")
def min_max(x):
    mn = F(np.inf)  # ggml starts from +-FLT_MAX; equal for finite input
    mx = F(-np.inf)
    for j in range(QK):
        if x[j] < mn:
            mn = x[j]
        if x[j] > mx:
            mx = x[j]
    return mn, mx


# ============================================================================ the types
@njit(**JIT)
def quantize_q4_0(xs, out):
    """block: d f16 | qs[16] (weights j and j + 16 in the low and high nibble of byte j)."""
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        d = abs_max_signed(x) / F(-8)
        inv = F(1) / d if d != F(0) else F(0)
        put_f16(o, 0, d)
        for j in range(16):
            q0 = min(15, np.int64(x[j] * inv + F(8.5)))
            q1 = min(15, np.int64(x[16 + j] * inv + F(8.5)))
            o[2 + j] = np.uint8(q0 | (q1 << 4))


@njit(**JIT)
def quantize_q4_1(xs, out):
    """block: d f16 | m f16 | qs[16]."""
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        mn, mx = min_max(x)
        d = (mx - mn) / F(15)
        inv = F(1) / d if d != F(0) else F(0)
        put_f16(o, 0, d)
        put_f16(o, 2, mn)
        for j in range(16):
            q0 = min(15, np.int64((x[j] - mn) * inv + F(0.5)))
            q1 = min(15, np.int64((x[16 + j] - mn) * inv + F(0.5)))
            o[4 + j] = np.uint8(q0 | (q1 << 4))


@njit(inline="always")
def pack_q5(x, o, at, inv, mn, bias):
    """32 five-bit codes of (x - mn) * inv + bias -> qh (4 bytes, bit j = code j's bit 4) | qs[16]."""
    qh = np.uint32(0)
    for j in range(16):
        q0 = min(31, np.int64((x[j] - mn) * inv + bias))
        q1 = min(31, np.int64((x[16 + j] - mn) * inv + bias))
        o[at + 4 + j] = np.uint8((q0 & 0xF) | ((q1 & 0xF) << 4))
        qh |= np.uint32((q0 >> 4) & 1) << np.uint32(j)
        qh |= np.uint32((q1 >> 4) & 1) << np.uint32(j + 16)
    for k in range(4):
        o[at + k] = np.uint8((qh >> np.uint32(8 * k)) & np.uint32(0xFF))


@njit(**JIT)
def quantize_q5_0(xs, out):
    """block: d f16 | qh u32 | qs[16]."""
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        d = abs_max_signed(x) / F(-16)
        inv = F(1) / d if d != F(0) else F(0)
        put_f16(o, 0, d)
        pack_q5(x, o, 2, inv, F(0), F(16.5))  # x - 0 is exact: ggml's x * id + 16.5


@njit(**JIT)
def quantize_q5_1(xs, out):
    """block: d f16 | m f16 | qh u32 | qs[16]."""
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        mn, mx = min_max(x)
        d = (mx - mn) / F(31)
        inv = F(1) / d if d != F(0) else F(0)
        put_f16(o, 0, d)
        put_f16(o, 2, mn)
        pack_q5(x, o, 4, inv, mn, F(0.5))


@njit(**JIT)
def quantize_q8_0(xs, out):
    """block: d f16 | qs int8[32], roundf(x / d) with d = amax / 127."""
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        amax = F(0)
        for j in range(QK):
            amax = max(amax, abs(x[j]))
        d = amax / F(127)
        inv = F(1) / d if d != F(0) else F(0)
        put_f16(o, 0, d)
        for j in range(QK):
            v = x[j] * inv
            a = abs(v)
            r = np.floor(a)
            if a - r >= F(0.5):  # exact: a - floor(a) has no rounding for float32 a
                r += F(1)
            q = np.int64(r)
            o[2 + j] = np.uint8((-q if v < F(0) else q) & 0xFF)


LEGACY_QUANTIZERS = {name: block_quantizer(name, kernel) for name, kernel in (
    ("Q4_0", quantize_q4_0), ("Q4_1", quantize_q4_1), ("Q5_0", quantize_q5_0), ("Q5_1", quantize_q5_1),
    ("Q8_0", quantize_q8_0))}
