"""K-quant encoders (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) that give ggml's reference quantizer's bytes.

gguf-py encodes the legacy types (Q4_0 ... Q8_0) exactly as ggml does but no K-quant. These follow
ggml's `quantize_row_q*_K_ref` (what llama-quantize runs without an importance matrix): the same
searches for a sub-block's scale and min, the same float32 operations in the same order, the same
rounding (ggml's `nearest_int`: add 1.5 * 2^23, keep the mantissa bits). ggml compiles that file
without FMA contraction, so every product and sum here is a separate float32 operation. Sums over a
sub-block are sequential (a loop over columns), never NumPy's pairwise reductions.

Every function works on many blocks at once: x float32 (n_blocks, 256) -> uint8 (n_blocks, type_size).
Blocks are independent, so the result is the same however a tensor is cut into calls.
"""
from __future__ import annotations

import numpy as np

QK_K = 256
F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)


# ============================================================================ helpers
def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: float32 -> int32, round half to even for |v| < 2^22 (bit trick, exact)."""
    t = (np.asarray(v, dtype=F32) + F32(12582912.0)).view(np.int32)
    return (t & 0x007FFFFF) - 0x00400000


def f16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its float16 (ggml's FP32_TO_FP16 then FP16_TO_FP32)."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """(n,) float32 -> (n, 2) uint8 little-endian float16."""
    return np.ascontiguousarray(np.asarray(v, dtype=F32).astype("<f2")).view(np.uint8).reshape(-1, 2)


def seq_sum(terms: np.ndarray) -> np.ndarray:
    """Sum (m, n) float32 over n left to right, as a C loop `s += t[i]` from s = 0 does."""
    # accumulate is sequential; "+ 0" makes an all -0.0 sum +0.0, as C's sum from s = 0 gives
    return np.cumsum(terms, axis=1, dtype=F32)[:, -1] + F32(0)


def first_abs_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, n) -> (max |x|, the signed x where it first occurs); C's `if (ax > amax)` from 0."""
    ax = np.abs(x)
    i = ax.argmax(axis=1)
    rows = np.arange(x.shape[0])
    return ax[rows, i], x[rows, i]


# ============================================================================ scale searches
def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int,
                     use_mad: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, w (m, n) -> (L uint8 (m, n) in [0, nmax], scale (m,), the_min (m,)) with x ≈ scale*L - the_min.

    ggml's make_qkx2_quants: start from min/max, try nstep+1 widened scales, keep the one whose
    weighted error (|d| or d^2) is smallest, refitting scale and min by least squares each time."""
    m, n = x.shape
    mn = np.minimum(x.min(axis=1), F32(0))
    mx = x.max(axis=1)
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    flat = mx == mn
    with np.errstate(all="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        Lf = L.astype(F32)

        def error(s, mn_, Lf_):
            d = (s[:, None] * Lf_ + mn_[:, None]) - x
            d = np.abs(d) if use_mad else d * d
            return seq_sum(w * d)

        best = error(scale, mn, Lf)
        cur_min = mn.copy()
        for step in range(nstep + 1):  # a better fit moves the min, and with it the next steps' grid
            isc = ((F32(rmin) + F32(rdelta) * F32(step)) + F32(nmax)) / (mx - cur_min)
            la = np.clip(nearest_int(isc[:, None] * (x - cur_min[:, None])), 0, nmax)
            laf = la.astype(F32)
            wl = w * laf
            sum_l = seq_sum(wl)
            sum_l2 = seq_sum(wl * laf)
            sum_xl = seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur = error(this_scale, this_min, laf)
            take = (D > 0) & (cur < best)
            L = np.where(take[:, None], la, L)
            best = np.where(take, cur, best)
            scale = np.where(take, this_scale, scale)
            cur_min = np.where(take, this_min, cur_min)
    L = np.where(flat[:, None], 0, L).astype(np.uint8)
    scale = np.where(flat, F32(0), scale).astype(F32)
    return L, scale, np.where(flat, -mn, -cur_min).astype(F32)


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x (m, n) -> (L int32 (m, n) in [0, 2*nmax), scale (m,)): ggml's make_q3_quants with do_rmse,
    a greedy per-weight refinement (5 passes) of x ≈ scale * (L - nmax) weighted by x^2."""
    amax, vmax = first_abs_max(x)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = F32(-nmax) / vmax
        L = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        w = x * x
        wx = w * x
        Lf = L.astype(F32)
        sumlx = seq_sum(wx * Lf)
        suml2 = seq_sum((w * Lf) * Lf)
        for _ in range(5):  # a block with no change in a pass would change nothing in the next
            for i in range(x.shape[1]):
                li = L[:, i].astype(F32)
                slx = sumlx - wx[:, i] * li
                sl2 = suml2 - (w[:, i] * li) * li
                new_l = np.clip(nearest_int((x[:, i] * sl2) / slx), -nmax, nmax - 1)
                nf = new_l.astype(F32)
                slx2 = slx + wx[:, i] * nf
                sl22 = sl2 + (w[:, i] * nf) * nf
                take = (slx > 0) & (new_l != L[:, i]) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
                L[:, i] = np.where(take, new_l, L[:, i])
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero[:, None], 0, L + nmax)
    return L, np.where(zero, F32(0), scale).astype(F32)


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """x (m, n) -> (L int32 (m, n) in [0, 2*nmax), scale (m,)): ggml's make_qx_quants with
    rmse_type 1 (weights x^2), trying 18 scales around nmax / max."""
    amax, vmax = first_abs_max(x)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def fit(iscale):
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = l.astype(F32)
        return l, seq_sum(wx * lf), seq_sum((w * lf) * lf)

    with np.errstate(all="ignore"):
        l, sumlx, suml2 = fit(F32(-nmax) / vmax)
        L = l + nmax
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
            l, sumlx, suml2 = fit(iscale)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(take[:, None], l + nmax, L)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
    return np.where(zero[:, None], 0, L), np.where(zero, F32(0), scale).astype(F32)


# ============================================================================ packing
def pack_2bit(L: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 -> (n, 64): byte h*32 + l holds weights h*128 + l + 32*k at bits 2k."""
    L = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)


def pack_4bit_pairs(L: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..15 -> (n, 128): byte h*32 + l = weight h*64 + l | weight h*64 + l + 32 << 4."""
    L = L.astype(np.uint8).reshape(-1, 4, 2, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(-1, 128)


def pack_k_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (n, 8) -> (n, 12) as Q4_K / Q5_K store them."""
    ls, lm = ls.astype(np.uint8), lm.astype(np.uint8)
    return np.concatenate([
        ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
        lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
        (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
    ], axis=1)


def requantize_affine(x: np.ndarray, L: np.ndarray, d: np.ndarray, dm: np.ndarray, qmax: int) -> np.ndarray:
    """The final pass of Q2_K / Q4_K / Q5_K: with the stored (rounded) d*sc and dmin*m of each
    sub-block, L = clamp(nearest_int((x + dm) / d), 0, qmax); sub-blocks with d == 0 keep L.
    x (m, n), L (m, n), d, dm (m,)."""
    with np.errstate(all="ignore"):
        new = np.clip(nearest_int((x + dm[:, None]) / d[:, None]), 0, qmax)
    return np.where((d != 0)[:, None], new, L)


def super_scales(scales: np.ndarray, mins: np.ndarray) -> tuple:
    """Per super-block: (max scale, max min) over sub-blocks from 0, as ggml's `if (s > max)`."""
    return np.maximum(scales.max(axis=1), F32(0)), np.maximum(mins.max(axis=1), F32(0))


# ============================================================================ the types
def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    L, scales, mins = make_qkx2_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
    scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
    max_scale, max_min = super_scales(scales, mins)
    with np.errstate(all="ignore"):
        ls = np.where((max_scale > 0)[:, None], nearest_int((F32(15) / max_scale)[:, None] * scales), 0)
        lm = np.where((max_min > 0)[:, None], nearest_int((F32(15) / max_min)[:, None] * mins), 0)
    sc = ((ls & 0xFF) | ((lm << 4) & 0xFF)).astype(np.uint8)  # (nb, 16)
    d = np.where(max_scale > 0, f16_round(max_scale / F32(15)), F32(0))
    dmin = np.where(max_min > 0, f16_round(max_min / F32(15)), F32(0))
    dl = (d[:, None] * (sc & 0xF).astype(F32)).reshape(-1)
    ml = (dmin[:, None] * (sc >> 4).astype(F32)).reshape(-1)
    L = requantize_affine(xs, L, dl, ml, 3).reshape(nb, QK_K)
    return np.concatenate([sc, pack_2bit(L), f16_bytes(d), f16_bytes(dmin)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    L, scales = make_q3_quants(xs, 4)
    scales = scales.reshape(nb, 16)
    amax, max_scale = first_abs_max(scales)
    has = max_scale != 0
    with np.errstate(all="ignore"):
        iscale = F32(-32) / max_scale
        l = nearest_int(iscale[:, None] * scales).astype(np.int8).astype(np.int32)
    l = np.where(has[:, None], np.clip(l, -32, 31) + 32, 32)  # stored biased by 32 (0 when unused)
    s = l.astype(np.uint8)
    packed = np.zeros((nb, 12), dtype=np.uint8)
    packed[:, :8] = (s[:, :8] & 0xF) | ((s[:, 8:] & 0xF) << 4)
    for j in range(16):
        packed[:, 8 + j % 4] |= (s[:, j] >> 4) << (2 * (j // 4))
    packed = np.where(has[:, None], packed, 0).astype(np.uint8)
    with np.errstate(all="ignore"):
        d = np.where(has, f16_round(F32(1) / iscale), F32(0))
        dl = (d[:, None] * (l - 32).astype(F32)).reshape(-1)
        new = np.clip(nearest_int(xs / dl[:, None]), -4, 3) + 4
    L = np.where((dl != 0)[:, None], new, L).reshape(nb, QK_K)
    hmask = np.zeros((nb, 32), dtype=np.uint8)
    for bit in range(8):  # weight j: hmask[j % 32] bit j // 32
        hmask |= ((L[:, bit * 32:(bit + 1) * 32] > 3).astype(np.uint8) << bit)
    L = np.where(L > 3, L - 4, L)
    return np.concatenate([hmask, pack_2bit(L), packed, f16_bytes(d)], axis=1)


def _quantize_q45_k(x: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Shared by Q4_K and Q5_K: (L (nb, 256), scales (nb, 12), d, dmin (nb,))."""
    nb = x.shape[0]
    xs = x.reshape(nb * 8, 32)
    with np.errstate(all="ignore"):
        av_x = np.sqrt(seq_sum(xs * xs) / F32(32))
    w = av_x[:, None] + np.abs(xs)
    L, scales, mins = make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, False)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = super_scales(scales, mins)
    with np.errstate(all="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
        ls = np.minimum(nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)
        lm = np.minimum(nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d = f16_round(max_scale / F32(63))
    dmin = f16_round(max_min / F32(63))
    dl = (d[:, None] * ls.astype(F32)).reshape(-1)
    ml = (dmin[:, None] * lm.astype(F32)).reshape(-1)
    L = requantize_affine(xs, L, dl, ml, nmax).reshape(nb, QK_K)
    return L, pack_k_scales(ls, lm), d, dmin


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    L, sc, d, dmin = _quantize_q45_k(x, 15, -1.0, 20)
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), sc, pack_4bit_pairs(L)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    L, sc, d, dmin = _quantize_q45_k(x, 31, -0.5, 15)
    L = L.astype(np.uint8)
    hi = L.reshape(-1, 4, 2, 32) >> 4  # (nb, pair h, half, 32): bit 2h + half of qh[l]
    qh = np.zeros((L.shape[0], 32), dtype=np.uint8)
    for h in range(4):
        qh |= (hi[:, h, 0] << (2 * h)) | (hi[:, h, 1] << (2 * h + 1))
    return np.concatenate([f16_bytes(d), f16_bytes(dmin), sc, qh, pack_4bit_pairs(L & 0xF)], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    xs = x.reshape(nb * 16, 16)
    L, scales = make_qx_quants_rmse1(xs, 32)
    scales = scales.reshape(nb, 16)
    amax, max_scale = first_abs_max(scales)
    zero = amax < GROUP_MAX_EPS
    with np.errstate(all="ignore"):
        iscale = F32(-128) / max_scale
        d = np.where(zero, F32(0), f16_round(F32(1) / iscale))
        sc = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        sc = np.where(zero[:, None], np.int8(0), sc)
        dl = (d[:, None] * sc.astype(F32)).reshape(-1)
        new = np.clip(nearest_int(xs / dl[:, None]), -32, 31) + 32
    L = np.where((dl != 0)[:, None], new, L).reshape(nb, QK_K).astype(np.uint8)
    L = L.reshape(-1, 2, 4, 32)  # (nb, half h, quarter k, 32): weight h*128 + k*32 + l
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4)
          | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), f16_bytes(d)], axis=1)
    out[zero] = 0
    return out


K_QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k,
                "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
