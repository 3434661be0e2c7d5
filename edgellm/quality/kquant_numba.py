"""Numba K-quant encoders: ggml's quantize_row_q*_K_ref as scalar loops, block by block.

The fast twins of edgellm.quality.kquant (vectorized NumPy, the readable reference): the same float32
operations in the same order, no fast-math (so no FMA contraction and no reassociation, as ggml's
reference file is compiled), the same rounding (nearest_int: add 1.5 * 2^23, keep the mantissa).
tests/test_quantize.py holds them to each other and both to llama.cpp's bytes.

Every entry point: x float32 (n_blocks, 256) C-contiguous, out uint8 (n_blocks, type_size).
"""
from __future__ import annotations

import numpy as np

from edgellm.kernels import cpu as _cpu

_cpu.use_cache_dir()  # before the cache=True functions below are defined

from edgellm.kernels.cpu.common import f32_as_u32, f32_to_f16_bits, njit, round_f16  # noqa: E402

F = np.float32
JIT = dict(cache=True, nogil=True)


# ============================================================================ helpers
@njit(inline="always")
def nearest_int(v):
    return np.int64(f32_as_u32(v + F(12582912.0)) & np.uint32(0x7FFFFF)) - 0x400000


@njit(inline="always")
def put_f16(o, at, v):
    h = f32_to_f16_bits(v)
    o[at] = np.uint8(h & 0xFF)
    o[at + 1] = np.uint8(h >> 8)


@njit(inline="always")
def make_qkx2(n, nmax, x, w, L, Laux, rmin, rdelta, nstep, use_mad):
    """-> (scale, the_min); L (n,) codes 0..nmax. ggml's make_qkx2_quants."""
    mn = x[0]
    mx = x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > F(0):
        mn = F(0)
    if mx == mn:
        for i in range(n):
            L[i] = 0
        return F(0), -mn
    iscale = F(nmax) / (mx - mn)
    scale = F(1) / iscale
    best = F(0)
    for i in range(n):
        li = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
        L[i] = li
        diff = scale * F(li) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F(step) + F(nmax)) / (mx - mn)
        sum_l = F(0)
        sum_l2 = F(0)
        sum_xl = F(0)
        for i in range(n):
            li = max(0, min(nmax, nearest_int(iscale * (x[i] - mn))))
            Laux[i] = li
            wl = w[i] * F(li)
            sum_l += wl
            sum_l2 += wl * F(li)
            sum_xl += wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > F(0):
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > F(0):
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            cur = F(0)
            for i in range(n):
                diff = this_scale * F(Laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur += w[i] * diff
            if cur < best:
                for i in range(n):
                    L[i] = Laux[i]
                best = cur
                scale = this_scale
                mn = this_min
    return scale, -mn


@njit(inline="always")
def first_abs_max(x, n):
    amax = F(0)
    vmax = F(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return amax, vmax


@njit(inline="always")
def make_q3(x, L, nmax):
    """ggml's make_q3_quants(16, nmax, do_rmse=True): L (16,) int codes 0..2*nmax-1 -> scale."""
    amax, vmax = first_abs_max(x, 16)
    if amax < F(1e-15):
        for i in range(16):
            L[i] = 0
        return F(0)
    iscale = F(-nmax) / vmax
    sumlx = F(0)
    suml2 = F(0)
    for i in range(16):
        li = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = li
        w = x[i] * x[i]
        sumlx += w * x[i] * F(li)
        suml2 += w * F(li) * F(li)
    for _ in range(5):
        n_changed = 0
        for i in range(16):
            w = x[i] * x[i]
            slx = sumlx - w * x[i] * F(L[i])
            if slx > F(0):
                sl2 = suml2 - w * F(L[i]) * F(L[i])
                new_l = max(-nmax, min(nmax - 1, nearest_int(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F(new_l)
                    sl2 += w * F(new_l) * F(new_l)
                    if sl2 > F(0) and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(16):
        L[i] += nmax
    return sumlx / suml2 if suml2 > F(0) else F(0)


@njit(inline="always")
def make_qx_rmse1(x, L, nmax):
    """ggml's make_qx_quants(16, nmax, rmse_type=1, no weights): L (16,) codes 0..2*nmax-1 -> scale."""
    amax, vmax = first_abs_max(x, 16)
    if amax < F(1e-15):
        for i in range(16):
            L[i] = 0
        return F(0)
    iscale = F(-nmax) / vmax
    sumlx = F(0)
    suml2 = F(0)
    for i in range(16):
        li = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
        L[i] = li + nmax
        w = x[i] * x[i]
        sumlx += w * x[i] * F(li)
        suml2 += w * F(li) * F(li)
    scale = sumlx / suml2 if suml2 != F(0) else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F(nmax) + F(0.1) * F(step)) / vmax
        sumlx = F(0)
        suml2 = F(0)
        for i in range(16):
            li = max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            w = x[i] * x[i]
            sumlx += w * x[i] * F(li)
            suml2 += w * F(li) * F(li)
        if suml2 > F(0) and sumlx * sumlx > best * suml2:
            for i in range(16):
                L[i] = nmax + max(-nmax, min(nmax - 1, nearest_int(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@njit(inline="always")
def pack_2bit(L, o, at):
    """256 codes 0..3 -> 64 bytes at o[at:]: byte h*32 + l holds weights h*128 + 32k + l at bits 2k."""
    for h in range(2):
        for l in range(32):
            j = 128 * h + l
            o[at + 32 * h + l] = np.uint8(L[j] | (L[j + 32] << 2) | (L[j + 64] << 4) | (L[j + 96] << 6))


@njit(inline="always")
def pack_k_scales(ls, lm, o, at):
    for j in range(8):
        if j < 4:
            o[at + j] = np.uint8(ls[j])
            o[at + j + 4] = np.uint8(lm[j])
        else:
            o[at + j + 4] = np.uint8((ls[j] & 0xF) | ((lm[j] & 0xF) << 4))
            o[at + j - 4] |= np.uint8((ls[j] >> 4) << 6)
            o[at + j] |= np.uint8((lm[j] >> 4) << 6)


# ============================================================================ the types
@njit(**JIT)
def quantize_q2_k(xs, out):
    L = np.empty(256, np.int64)
    Laux = np.empty(16, np.int64)
    w = np.empty(16, F)
    scales = np.empty(16, F)
    mins = np.empty(16, F)
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        max_scale = F(0)
        max_min = F(0)
        for j in range(16):
            for l in range(16):
                w[l] = abs(x[16 * j + l])
            sc, mn = make_qkx2(16, 3, x[16 * j:16 * j + 16], w, L[16 * j:16 * j + 16], Laux, F(-0.5), F(0.1), 15,
                               True)
            scales[j] = sc
            mins[j] = mn
            if sc > max_scale:
                max_scale = sc
            if mn > max_min:
                max_min = mn
        for j in range(16):
            o[j] = 0
        d = F(0)
        dmin = F(0)
        if max_scale > F(0):
            iscale = F(15) / max_scale
            for j in range(16):
                o[j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
            d = round_f16(max_scale / F(15))
        if max_min > F(0):
            iscale = F(15) / max_min
            for j in range(16):
                o[j] |= np.uint8((nearest_int(iscale * mins[j]) << 4) & 0xFF)
            dmin = round_f16(max_min / F(15))
        put_f16(o, 80, d)
        put_f16(o, 82, dmin)
        for j in range(16):
            dl = d * F(o[j] & 0xF)
            if dl == F(0):
                continue
            ml = dmin * F(o[j] >> 4)
            for ii in range(16):
                L[16 * j + ii] = max(0, min(3, nearest_int((x[16 * j + ii] + ml) / dl)))
        pack_2bit(L, o, 16)


@njit(**JIT)
def quantize_q3_k(xs, out):
    L = np.empty(256, np.int64)
    scales = np.empty(16, F)
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        amax = F(0)
        max_scale = F(0)
        for j in range(16):
            s = make_q3(x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], 4)
            scales[j] = s
            if abs(s) > amax:
                amax = abs(s)
                max_scale = s
        for k in range(12):
            o[96 + k] = 0
        d = F(0)
        if max_scale != F(0):
            iscale = F(-32) / max_scale
            for j in range(16):
                l8 = np.int64(np.int8(nearest_int(iscale * scales[j]) & 0xFF))  # C: int8_t l = nearest_int(..)
                l8 = max(-32, min(31, l8)) + 32
                if j < 8:
                    o[96 + j] = np.uint8(l8 & 0xF)
                else:
                    o[96 + j - 8] |= np.uint8((l8 & 0xF) << 4)
                o[96 + 8 + j % 4] |= np.uint8((l8 >> 4) << (2 * (j // 4)))
            d = round_f16(F(1) / iscale)
        put_f16(o, 108, d)
        for j in range(16):
            if j < 8:
                sc = o[96 + j] & 0xF
            else:
                sc = o[96 + j - 8] >> 4
            sc = (np.int64(sc) | (np.int64((o[96 + 8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
            dl = d * F(sc)
            if dl == F(0):
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-4, min(3, nearest_int(x[16 * j + ii] / dl))) + 4
        for k in range(32):
            o[k] = 0
        m = 0
        hm = 1
        for j in range(256):
            if L[j] > 3:
                o[m] |= np.uint8(hm)
                L[j] -= 4
            m += 1
            if m == 32:
                m = 0
                hm <<= 1
        pack_2bit(L, o, 32)


@njit(inline="always")
def _q45_k(x, L, Laux, w, scales, mins, ls, lm, nmax, rmin, nstep):
    """Scales, mins and codes of one Q4_K / Q5_K super-block -> (d, dmin) as stored (f16 values)."""
    max_scale = F(0)
    max_min = F(0)
    for j in range(8):
        xj = x[32 * j:32 * j + 32]
        sum_x2 = F(0)
        for l in range(32):
            sum_x2 += xj[l] * xj[l]
        av_x = np.sqrt(sum_x2 / F(32))
        for l in range(32):
            w[l] = av_x + abs(xj[l])
        sc, mn = make_qkx2(32, nmax, xj, w, L[32 * j:32 * j + 32], Laux, rmin, F(0.1), nstep, False)
        scales[j] = sc
        mins[j] = mn
        if sc > max_scale:
            max_scale = sc
        if mn > max_min:
            max_min = mn
    inv_scale = F(63) / max_scale if max_scale > F(0) else F(0)
    inv_min = F(63) / max_min if max_min > F(0) else F(0)
    for j in range(8):
        ls[j] = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm[j] = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
    d = round_f16(max_scale / F(63))
    dmin = round_f16(max_min / F(63))
    for j in range(8):
        dl = d * F(ls[j])
        if dl == F(0):
            continue
        dm = dmin * F(lm[j])
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((x[32 * j + ii] + dm) / dl)))
    return d, dmin


@njit(**JIT)
def quantize_q4_k(xs, out):
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    w = np.empty(32, F)
    scales = np.empty(8, F)
    mins = np.empty(8, F)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for b in range(xs.shape[0]):
        o = out[b]
        d, dmin = _q45_k(xs[b], L, Laux, w, scales, mins, ls, lm, 15, F(-1.0), 20)
        put_f16(o, 0, d)
        put_f16(o, 2, dmin)
        pack_k_scales(ls, lm, o, 4)
        for h in range(4):
            for l in range(32):
                o[16 + 32 * h + l] = np.uint8(L[64 * h + l] | (L[64 * h + l + 32] << 4))


@njit(**JIT)
def quantize_q5_k(xs, out):
    L = np.empty(256, np.int64)
    Laux = np.empty(32, np.int64)
    w = np.empty(32, F)
    scales = np.empty(8, F)
    mins = np.empty(8, F)
    ls = np.empty(8, np.int64)
    lm = np.empty(8, np.int64)
    for b in range(xs.shape[0]):
        o = out[b]
        d, dmin = _q45_k(xs[b], L, Laux, w, scales, mins, ls, lm, 31, F(-0.5), 15)
        put_f16(o, 0, d)
        put_f16(o, 2, dmin)
        pack_k_scales(ls, lm, o, 4)
        for k in range(32):
            o[16 + k] = 0
        for h in range(4):
            for j in range(32):
                l1 = L[64 * h + j]
                l2 = L[64 * h + j + 32]
                if l1 > 15:
                    l1 -= 16
                    o[16 + j] |= np.uint8(1 << (2 * h))
                if l2 > 15:
                    l2 -= 16
                    o[16 + j] |= np.uint8(2 << (2 * h))
                o[48 + 32 * h + j] = np.uint8(l1 | (l2 << 4))


@njit(**JIT)
def quantize_q6_k(xs, out):
    L = np.empty(256, np.int64)
    scales = np.empty(16, F)
    for b in range(xs.shape[0]):
        x = xs[b]
        o = out[b]
        max_scale = F(0)
        max_abs = F(0)
        for j in range(16):
            s = make_qx_rmse1(x[16 * j:16 * j + 16], L[16 * j:16 * j + 16], 32)
            scales[j] = s
            if abs(s) > max_abs:
                max_abs = abs(s)
                max_scale = s
        if max_abs < F(1e-15):
            for k in range(o.shape[0]):
                o[k] = 0
            continue
        iscale = F(-128) / max_scale
        d = round_f16(F(1) / iscale)
        put_f16(o, 208, d)
        for j in range(16):
            o[192 + j] = np.uint8(min(127, nearest_int(iscale * scales[j])) & 0xFF)
        for j in range(16):
            dl = d * F(np.int8(o[192 + j]))
            if dl == F(0):
                continue
            for ii in range(16):
                L[16 * j + ii] = max(-32, min(31, nearest_int(x[16 * j + ii] / dl))) + 32
        for h in range(2):
            for l in range(32):
                j = 128 * h + l
                o[64 * h + l] = np.uint8((L[j] & 0xF) | ((L[j + 64] & 0xF) << 4))
                o[64 * h + l + 32] = np.uint8((L[j + 32] & 0xF) | ((L[j + 96] & 0xF) << 4))
                o[128 + 32 * h + l] = np.uint8((L[j] >> 4) | ((L[j + 32] >> 4) << 2) | ((L[j + 64] >> 4) << 4)
                                               | ((L[j + 96] >> 4) << 6))


def block_quantizer(name: str, kernel):
    """quantize(x) -> uint8 (n_blocks, type_size) for a Numba block kernel(xs, out) of type `name`
    (block and byte sizes from edgellm.quants' registry); shared with legacy_numba."""
    from gguf import GGMLQuantizationType

    from edgellm.quants import QUANT_TYPES

    qt = QUANT_TYPES[GGMLQuantizationType[name]]

    def quantize(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, qt.block_size)
        out = np.empty((x.shape[0], qt.type_size), dtype=np.uint8)
        kernel(x, out)
        return out

    quantize.__name__ = f"quantize_{name.lower()}"
    return quantize


K_QUANTIZERS = {name: block_quantizer(name, kernel) for name, kernel in (
    ("Q2_K", quantize_q2_k), ("Q3_K", quantize_q3_k), ("Q4_K", quantize_q4_k), ("Q5_K", quantize_q5_k),
    ("Q6_K", quantize_q6_k))}
