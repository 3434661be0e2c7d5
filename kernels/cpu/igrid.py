"""The grid IQ types: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (super-blocks of 256, activations
"q8_k"). Layouts: edgellm/quants.py; their NumPy twins: reference.igrid_parts.

A super-block is first decoded into 256 signed int8 values (grid entry * sign; |value| <= 62) and
16 odd multipliers 2 ls + 1 (one per 16 weights), then multiplied with x in llama.cpp's orders
(the integer sums are exact; only the float steps are order-sensitive):
  fewer than 8 tokens, ggml_vec_dot_<t>_q8_K (AVX2): 8 integer lanes, lane j the sum over the
      sub-blocks of (2 ls + 1) * the products of weights 4j .. 4j + 3; acc = fma(d_w * d_x,
      f32(lanes), acc); mult * hsum_float_8(acc)
  8 tokens or more, llama.cpp's tiled kernel: res = (d_w * mult) * f32(s1), acc = fma(res, d_x, acc)
mult is 1/8 (IQ2), 1/4 (IQ3_XXS) or 1 (IQ3_S). A block is decoded once per row and used for every
token of a batch. Dequantize follows gguf.quants operation for operation: bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants as gq
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgellm.kernels.cpu.common import F32, I32, JIT, U, f16_to_f32, load_f16, njit, prange
from edgellm.kernels.cpu.iquants import _fma_ints, hsum8
from edgellm.kernels.cpu.ir.builder import abs_sign, fma32, i32, load_bytes, quad_sums

TILED_MIN = 8  # batches from this many tokens on take llama.cpp's tiled order


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.int8))


GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S = _grid(gq.IQ2_XXS), _grid(gq.IQ2_XS), _grid(gq.IQ2_S)
GRID_IQ3_XXS, GRID_IQ3_S = _grid(gq.IQ3_XXS), _grid(gq.IQ3_S)
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).copy()  # 7 sign bits -> 8 (an even count)

# kind: 0 IQ2_XXS, 1 IQ2_XS, 2 IQ2_S, 3 IQ3_XXS, 4 IQ3_S
BYTES = (66, 74, 82, 98, 110)
MULT = (0.125, 0.125, 0.125, 0.25, 1.0)


@njit(inline="always")
def _u32(row, o):
    return (U(row[o]) | (U(row[o + U(1)]) << U(8)) | (U(row[o + U(2)]) << U(16))
            | (U(row[o + U(3)]) << U(24)))


@njit(inline="always")
def _put8(v, at, g, idx, signs):
    """v[at:at + 8] = the 8-value grid entry idx of g, negated where bit k of signs is set."""
    for k in range(8):
        m = I32(g[idx, k])
        v[at + U(k)] = np.int8(-m if (signs >> U(k)) & U(1) else m)


@njit(inline="always")
def _put4(v, at, g, idx, signs, shift):
    """v[at:at + 4] = the 4-value grid entry idx of g, signed by bits shift .. shift + 3 of signs."""
    for k in range(4):
        m = I32(g[idx, k])
        v[at + U(k)] = np.int8(-m if (signs >> (shift + U(k))) & U(1) else m)


@njit(inline="always")
def _decode(kind, row, o, v, ls):
    """The super-block at byte o: values into v (int8 256), the 4-bit scales into ls (int32 16, one
    per 16 weights); returns d (float32)."""
    if kind == 0:  # IQ2_XXS: per 32, u32 of 4 grid bytes, u32 of 4 x 7 sign bits and ls
        for s in range(U(8)):
            q = o + U(2) + U(8) * s
            aux = _u32(row, q + U(4))
            for g in range(U(4)):
                _put8(v, U(32) * s + U(8) * g, GRID_IQ2_XXS, row[q + g], U(KSIGNS[(aux >> (U(7) * g)) & U(127)]))
            ls[U(2) * s] = ls[U(2) * s + U(1)] = I32(aux >> U(28))
    elif kind == 1:  # IQ2_XS: u16 of 9-bit grid index and 7 sign bits; ls per 16
        for s in range(U(8)):
            for g in range(U(4)):
                q = o + U(2) + U(8) * s + U(2) * g
                w = U(row[q]) | (U(row[q + U(1)]) << U(8))
                _put8(v, U(32) * s + U(8) * g, GRID_IQ2_XS, w & U(511), U(KSIGNS[w >> U(9)]))
            sc = I32(row[o + U(66) + s])
            ls[U(2) * s], ls[U(2) * s + U(1)] = sc & I32(15), sc >> I32(4)
    elif kind == 2:  # IQ2_S: grid byte + 2 high bits from qh, a sign byte per 8; ls per 16
        for s in range(U(8)):
            qh = U(row[o + U(66) + s])
            for g in range(U(4)):
                idx = U(row[o + U(2) + U(4) * s + g]) | (((qh >> (U(2) * g)) & U(3)) << U(8))
                _put8(v, U(32) * s + U(8) * g, GRID_IQ2_S, idx, U(row[o + U(34) + U(4) * s + g]))
            sc = I32(row[o + U(74) + s])
            ls[U(2) * s], ls[U(2) * s + U(1)] = sc & I32(15), sc >> I32(4)
    elif kind == 3:  # IQ3_XXS: 8 grid bytes per 32, a u32 of 4 x 7 sign bits and ls
        for s in range(U(8)):
            aux = _u32(row, o + U(66) + U(4) * s)
            for g in range(U(4)):
                signs = U(KSIGNS[(aux >> (U(7) * g)) & U(127)])
                q = o + U(2) + U(8) * s + U(2) * g
                _put4(v, U(32) * s + U(8) * g, GRID_IQ3_XXS, row[q], signs, U(0))
                _put4(v, U(32) * s + U(8) * g + U(4), GRID_IQ3_XXS, row[q + U(1)], signs, U(4))
            ls[U(2) * s] = ls[U(2) * s + U(1)] = I32(aux >> U(28))
    else:  # IQ3_S: grid byte + 1 high bit from qh, a sign byte per 8; ls per 32
        for s in range(U(8)):
            qh = U(row[o + U(66) + s])
            for g in range(U(4)):
                signs = U(row[o + U(74) + U(4) * s + g])
                q = o + U(2) + U(8) * s + U(2) * g
                _put4(v, U(32) * s + U(8) * g, GRID_IQ3_S,
                      U(row[q]) | (((qh >> (U(2) * g)) & U(1)) << U(8)), signs, U(0))
                _put4(v, U(32) * s + U(8) * g + U(4), GRID_IQ3_S,
                      U(row[q + U(1)]) | (((qh >> (U(2) * g + U(1))) & U(1)) << U(8)), signs, U(4))
            sc = I32(row[o + U(106) + s // U(2)])
            ls[U(2) * s] = ls[U(2) * s + U(1)] = (sc >> I32(U(4) * (s & U(1)))) & I32(15)
    return f16_to_f32(row[o], row[o + U(1)])


@intrinsic
def _lanes_into(typingctx, v, v_off, x, x_off, s_lo, s_hi, acc):
    """acc[0:8] (int32) += lane j's products of v[v_off + 4j ..] (int8) and x[x_off + 4j ..] (int8),
    lanes 0-3 times s_lo, 4-7 times s_hi (exact)."""
    sig = types.none(v, types.uint64, x, types.uint64, types.int32, types.int32, acc)

    def codegen(context, builder, signature, args):
        w = load_bytes(context, builder, signature.args[0], args[0], args[1], 32)
        xv = load_bytes(context, builder, signature.args[2], args[2], args[3], 32)
        u, s = abs_sign(builder, w, xv)
        q = quad_sums(builder, u, s)
        lo = builder.insert_element(ir.Constant(i32(8), ir.Undefined), args[4], ir.Constant(ir.IntType(32), 0))
        hi = builder.insert_element(ir.Constant(i32(8), ir.Undefined), args[5], ir.Constant(ir.IntType(32), 0))
        scale = builder.shuffle_vector(lo, hi, ir.Constant(i32(8), [0, 0, 0, 0, 8, 8, 8, 8]))
        data = context.make_array(signature.args[6])(context, builder, args[6]).data
        ptr = builder.bitcast(data, i32(8).as_pointer())
        builder.store(builder.add(builder.load(ptr, align=4), builder.mul(q, scale)), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _block_lanes(v, ls, xq, xo, iq):
    """iq (int32 8) += the super-block's 8 lanes with x at xq[xo:]."""
    for s in range(U(8)):
        _lanes_into(v, U(32) * s, xq, xo + U(32) * s, I32(I32(2) * ls[U(2) * s] + I32(1)),
                    I32(I32(2) * ls[U(2) * s + U(1)] + I32(1)), iq)


@njit(inline="always")
def _product(kind, raw, xq, xd, out):
    """out (n_tok, n_rows) = raw's rows times the tokens' "q8_k" parts, in llama.cpp's order for
    the batch size; rows by chunks of 16, each super-block decoded once for every token."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    size = U(BYTES[kind])
    mult = F32(MULT[kind])
    tiled = n_tok >= TILED_MIN
    for c in prange((n_rows + 15) // 16):
        v = np.empty(256, np.int8)
        ls = np.empty(16, I32)
        iq = np.zeros(8, I32)
        acc = np.empty((n_tok, 8), F32)
        for r in range(c * 16, min(c * 16 + 16, n_rows)):
            row = raw[r]
            acc[:] = F32(0.0)
            for j in range(nb):
                dw = _decode(kind, row, U(j) * size, v, ls)
                for t in range(n_tok):
                    b = U(t) * nb + U(j)
                    _block_lanes(v, ls, xq, b * U(256), iq)
                    if tiled:
                        s1 = I32(0)
                        for k in range(8):
                            s1 += iq[k]
                            iq[k] = I32(0)
                        acc[t, 0] = fma32(F32(dw * mult) * F32(s1), xd[b], acc[t, 0])
                    else:
                        _fma_ints(dw * xd[b], iq, acc[t])
            for t in range(n_tok):
                out[t, r] = acc[t, 0] if tiled else mult * hsum8(acc[t])


@njit(inline="always")
def _dequantize(kind, raw, out):
    """w = (db * |grid|) * sign, db as gguf.quants computes it (float32 steps)."""
    size = U(BYTES[kind])
    for r in prange(raw.shape[0]):
        v = np.empty(256, np.int8)
        ls = np.empty(16, I32)
        row, dst = raw[r], out[r]
        for j in range(U(out.shape[1] // 256)):
            d = _decode(kind, row, j * size, v, ls)
            for h in range(16):
                if kind == 4:
                    db = d * F32(I32(1) + I32(2) * ls[h])
                else:
                    db = (d * (F32(0.5) + F32(ls[h]))) * F32(0.25 if kind < 3 else 0.5)
                for k in range(16):
                    q = I32(v[16 * h + k])
                    w = db * F32(-q if q < 0 else q)
                    dst[j * U(256) + U(16 * h + k)] = -w if q < 0 else w


@njit(**JIT)
def dequantize_iq2_xxs(raw, out, lanes):
    _dequantize(0, raw, out)


@njit(**JIT)
def dequantize_iq2_xs(raw, out, lanes):
    _dequantize(1, raw, out)


@njit(**JIT)
def dequantize_iq2_s(raw, out, lanes):
    _dequantize(2, raw, out)


@njit(**JIT)
def dequantize_iq3_xxs(raw, out, lanes):
    _dequantize(3, raw, out)


@njit(**JIT)
def dequantize_iq3_s(raw, out, lanes):
    _dequantize(4, raw, out)


@njit(**JIT)
def matmul_iq2_xxs(raw, xq, xd, xs, xm, out):
    _product(0, raw, xq, xd, out)


@njit(**JIT)
def matmul_iq2_xs(raw, xq, xd, xs, xm, out):
    _product(1, raw, xq, xd, out)


@njit(**JIT)
def matmul_iq2_s(raw, xq, xd, xs, xm, out):
    _product(2, raw, xq, xd, out)


@njit(**JIT)
def matmul_iq3_xxs(raw, xq, xd, xs, xm, out):
    _product(3, raw, xq, xd, out)


@njit(**JIT)
def matmul_iq3_s(raw, xq, xd, xs, xm, out):
    _product(4, raw, xq, xd, out)


@njit(**JIT)
def matvec_iq2_xxs(raw, xq, xd, xs, xm, out):
    _product(0, raw, xq, xd, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq2_xs(raw, xq, xd, xs, xm, out):
    _product(1, raw, xq, xd, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq2_s(raw, xq, xd, xs, xm, out):
    _product(2, raw, xq, xd, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq3_xxs(raw, xq, xd, xs, xm, out):
    _product(3, raw, xq, xd, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq3_s(raw, xq, xd, xs, xm, out):
    _product(4, raw, xq, xd, out.reshape(1, out.size))


KERNELS = {
    GGMLType.IQ2_XXS: (dequantize_iq2_xxs, matvec_iq2_xxs),
    GGMLType.IQ2_XS: (dequantize_iq2_xs, matvec_iq2_xs),
    GGMLType.IQ2_S: (dequantize_iq2_s, matvec_iq2_s),
    GGMLType.IQ3_XXS: (dequantize_iq3_xxs, matvec_iq3_xxs),
    GGMLType.IQ3_S: (dequantize_iq3_s, matvec_iq3_s),
}
MATMUL = {GGMLType.IQ2_XXS: matmul_iq2_xxs, GGMLType.IQ2_XS: matmul_iq2_xs, GGMLType.IQ2_S: matmul_iq2_s,
          GGMLType.IQ3_XXS: matmul_iq3_xxs, GGMLType.IQ3_S: matmul_iq3_s}
