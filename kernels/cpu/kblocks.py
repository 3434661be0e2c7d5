"""The K-quant super-block layouts (Q2_K .. Q6_K: 256 weights a block) and the scale fields the
kernels of kquants.py and ktiled.py read, in ggml's bit layout."""
from __future__ import annotations

from edgellm.kernels.cpu.common import I32, U, njit

QK_K = 256
# Bytes per super-block, fields in memory order.
Q2_K_BYTES = 16 + 64 + 2 + 2  # scales[16] (sc | min << 4) | qs[64] | d | dmin
Q3_K_BYTES = 32 + 64 + 12 + 2  # hmask[32] | qs[64] | scales[12] | d
Q4_K_BYTES = 2 + 2 + 12 + 128  # d | dmin | scales[12] | qs[128]
Q5_K_BYTES = 2 + 2 + 12 + 32 + 128  # d | dmin | scales[12] | qh[32] | qs[128]
Q6_K_BYTES = 128 + 64 + 16 + 2  # ql[128] | qh[64] | scales: i8[16] | d


@njit(inline="always")
def q3_scale(row, o, g):
    """6-bit scale of group g (0..15) of a Q3_K block whose scales[12] start at byte o, minus 32."""
    lo = (I32(row[o + (g & U(7))]) >> I32(4 * (g >> U(3)))) & I32(15)
    hi = (I32(row[o + U(8) + (g & U(3))]) >> I32(2 * (g >> U(2)))) & I32(3)
    return (lo | (hi << I32(4))) - I32(32)


@njit(inline="always")
def scale_min(row, o, b):
    """(scale, min) of sub-block b (0..7) of a Q4_K/Q5_K block whose scales[12] start at byte o."""
    if b < U(4):
        return I32(row[o + b]) & I32(63), I32(row[o + b + U(4)]) & I32(63)
    sc = (I32(row[o + b + U(4)]) & I32(15)) | ((I32(row[o + b - U(4)]) >> I32(6)) << I32(4))
    mn = (I32(row[o + b + U(4)]) >> I32(4)) | ((I32(row[o + b]) >> I32(6)) << I32(4))
    return sc, mn
