"""The grid IQ types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M and the ternary TQ1_0,
TQ2_0 (super-blocks of 256, activations "q8_k"). Layouts: edgellm/quants.py; their NumPy twins:
reference.igrid_parts, reference.tq_codes, reference.iq1_parts.

A super-block is first decoded into 256 signed int8 values (grid entry * sign; |value| <= 62) and
16 odd multipliers 2 ls + 1 (one per 16 weights), then multiplied with x in llama.cpp's orders
(the integer sums are exact; only the float steps are order-sensitive):
  fewer than 8 tokens, ggml_vec_dot_<t>_q8_K (AVX2): 8 integer lanes, lane j the sum over the
      sub-blocks of (2 ls + 1) * the products of weights 4j .. 4j + 3; acc = fma(d_w * d_x,
      f32(lanes), acc); mult * hsum_float_8(acc)
  8 tokens or more, llama.cpp's tiled kernel: res = (d_w * mult) * f32(s1), acc = fma(res, d_x, acc)
mult is 1/8 (IQ2), 1/4 (IQ3_XXS) or 1 (IQ3_S). The TQ types keep their codes 0..2 (weight + 1) and
take ggml's vec_dot for every batch size: lane j as above with multiplier 1, less the two Q8_K sums
of 16 of x at lane j's position (bsums 2j, 2j + 1), then the same fma and hsum_float_8.
IQ1_S / IQ1_M: the vec_dot lanes of the grid values (-1 / 0 / 1), plus the deltas' lanes (IQ1_M, a
second accumulator) or their integer sum (IQ1_S, a scalar fma); hsum + 1/8 * the delta part. Their
tiled order takes the codes 8 * grid + delta sign with d / 8.
A block is decoded once per row and used for every token of a batch: with 512-bit VNNI, 16 rows
at a time into int16 weights times multipliers, four tokens per row call (vpdpwssd); elsewhere
x + 128 (unsigned) against the signed weights, less the lanes of 128 * the weights. One token of
IQ3_S / IQ2_XXS decodes in registers (_fused_lanes). Dequantize follows gguf.quants operation for
operation: bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import quants as gq
from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic, overload

from edgellm.kernels.cpu.common import F32, I32, JIT, KVALUES, U, f16_to_f32, hsum8, njit, prange, xs_scale
from edgellm.kernels.cpu.host import ZMM_VNNI
from edgellm.kernels.cpu.ir.builder import (abs_sign, array_ptr, fma32, fma_ints, i8, i16, i32, llvm_fn, load_vec, madd16,
                                             maddubs16, reduce4, splat)

TILED_MIN = 8  # batches from this many tokens on take llama.cpp's tiled order
# batches multiply int16 weights-times-multipliers with x by vpdpwssd where 512-bit VNNI exists
W16 = ZMM_VNNI


def _grid(cls) -> np.ndarray:
    """The grid, each entry's int8 values packed little-endian: uint64 (8 values) or uint32 (4)."""
    cls.init_grid()
    g = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.uint8))
    return g.view(np.uint64 if g.shape[1] == 8 else np.uint32).reshape(-1).copy()


GRID_IQ2_XXS, GRID_IQ2_XS, GRID_IQ2_S = _grid(gq.IQ2_XXS), _grid(gq.IQ2_XS), _grid(gq.IQ2_S)
GRID_IQ3_XXS, GRID_IQ3_S = _grid(gq.IQ3_XXS), _grid(gq.IQ3_S)
GRID_IQ1 = _grid(gq.IQ1_S)  # values -1, 0, 1 (IQ1_S and IQ1_M)
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, np.uint8).astype(np.uint64)  # 7 sign bits -> 8 (an even count)

# kind: 0 IQ2_XXS, 1 IQ2_XS, 2 IQ2_S, 3 IQ3_XXS, 4 IQ3_S, 5 TQ1_0, 6 TQ2_0, 7 IQ1_S, 8 IQ1_M,
# 9 IQ4_XS (its batches of 8+ tokens only: iquants.matmul_iq4_xs)
BYTES = (66, 74, 82, 98, 110, 54, 66, 50, 56, 136)
MULT = (0.125, 0.125, 0.125, 0.25, 1.0, 1.0, 1.0, 0.125, 0.125, 1.0)
POW3 = np.array([1, 3, 9, 27, 81], np.uint64)  # TQ1_0 packs 5 (4 in qh) base-3 digits per byte


@njit(inline="always")
def _u32(row, o):
    return (U(row[o]) | (U(row[o + U(1)]) << U(8)) | (U(row[o + U(2)]) << U(16))
            | (U(row[o + U(3)]) << U(24)))


@intrinsic
def _expand32(typingctx, v, v_off, g0, g1, g2, g3, signs):
    """v[v_off:v_off + 32] (int8) = the bytes of g0 .. g3 (uint64, little-endian), negated where
    bit i of signs (uint64, low 32 bits) is set."""
    sig = types.none(v, types.uint64, types.uint64, types.uint64, types.uint64, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        g = ir.Constant(ir.VectorType(i64, 4), ir.Undefined)
        for k in range(4):
            g = builder.insert_element(g, args[2 + k], ir.Constant(ir.IntType(32), k))
        g = builder.bitcast(g, i8(32))
        sb = builder.bitcast(builder.trunc(args[6], ir.IntType(32)), i8(4))
        spread = builder.shuffle_vector(sb, sb, ir.Constant(i32(32), [i // 8 for i in range(32)]))
        bits = ir.Constant(i8(32), [1 << (i % 8) for i in range(32)])
        neg = builder.icmp_unsigned("!=", builder.and_(spread, bits), ir.Constant(i8(32), [0] * 32))
        val = builder.select(neg, builder.sub(ir.Constant(i8(32), [0] * 32), g), g)
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), i8(32).as_pointer())
        builder.store(val, ptr, align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _expand8(v, at, g):
    """v[at:at + 8] = the 8 bytes of g (uint64, little-endian) as int8."""
    for k in range(8):
        v[at + U(k)] = np.int8(np.uint8((g >> U(8 * k)) & U(255)))


@njit(inline="always")
def _u16(row, o):
    return U(row[o]) | (U(row[o + U(1)]) << U(8))


@njit(inline="always")
def _pair(g, a, b):
    """Two 4-value grid entries as one uint64 (a's values first)."""
    return U(g[a]) | (U(g[b]) << U(32))


@njit(inline="always")
def _decode_iq2_xxs(row, o, v, ls, vd):
    """IQ2_XXS: per 32, u32 of 4 grid bytes, u32 of 4 x 7 sign bits and ls."""
    for s in range(U(8)):
        q = o + U(2) + U(8) * s
        aux = _u32(row, q + U(4))
        signs = (KSIGNS[aux & U(127)] | (KSIGNS[(aux >> U(7)) & U(127)] << U(8))
                 | (KSIGNS[(aux >> U(14)) & U(127)] << U(16)) | (KSIGNS[(aux >> U(21)) & U(127)] << U(24)))
        _expand32(v, U(32) * s, GRID_IQ2_XXS[row[q]], GRID_IQ2_XXS[row[q + U(1)]],
                  GRID_IQ2_XXS[row[q + U(2)]], GRID_IQ2_XXS[row[q + U(3)]], signs)
        ls[U(2) * s] = ls[U(2) * s + U(1)] = I32(aux >> U(28))
    return _u16(row, o)


@njit(inline="always")
def _decode_iq2_xs(row, o, v, ls, vd):
    """IQ2_XS: u16 of 9-bit grid index and 7 sign bits; ls per 16."""
    for s in range(U(8)):
        q = o + U(2) + U(8) * s
        w0 = U(row[q]) | (U(row[q + U(1)]) << U(8))
        w1 = U(row[q + U(2)]) | (U(row[q + U(3)]) << U(8))
        w2 = U(row[q + U(4)]) | (U(row[q + U(5)]) << U(8))
        w3 = U(row[q + U(6)]) | (U(row[q + U(7)]) << U(8))
        signs = (KSIGNS[w0 >> U(9)] | (KSIGNS[w1 >> U(9)] << U(8)) | (KSIGNS[w2 >> U(9)] << U(16))
                 | (KSIGNS[w3 >> U(9)] << U(24)))
        _expand32(v, U(32) * s, GRID_IQ2_XS[w0 & U(511)], GRID_IQ2_XS[w1 & U(511)],
                  GRID_IQ2_XS[w2 & U(511)], GRID_IQ2_XS[w3 & U(511)], signs)
        sc = I32(row[o + U(66) + s])
        ls[U(2) * s], ls[U(2) * s + U(1)] = sc & I32(15), sc >> I32(4)
    return _u16(row, o)


@njit(inline="always")
def _decode_iq2_s(row, o, v, ls, vd):
    """IQ2_S: grid byte + 2 high bits from qh, a sign byte per 8; ls per 16."""
    for s in range(U(8)):
        qh = U(row[o + U(66) + s])
        q = o + U(2) + U(4) * s
        _expand32(v, U(32) * s, GRID_IQ2_S[U(row[q]) | ((qh & U(3)) << U(8))],
                  GRID_IQ2_S[U(row[q + U(1)]) | (((qh >> U(2)) & U(3)) << U(8))],
                  GRID_IQ2_S[U(row[q + U(2)]) | (((qh >> U(4)) & U(3)) << U(8))],
                  GRID_IQ2_S[U(row[q + U(3)]) | ((qh >> U(6)) << U(8))], _u32(row, o + U(34) + U(4) * s))
        sc = I32(row[o + U(74) + s])
        ls[U(2) * s], ls[U(2) * s + U(1)] = sc & I32(15), sc >> I32(4)
    return _u16(row, o)


@njit(inline="always")
def _decode_iq3_xxs(row, o, v, ls, vd):
    """IQ3_XXS: 8 grid bytes per 32, a u32 of 4 x 7 sign bits and ls."""
    for s in range(U(8)):
        aux = _u32(row, o + U(66) + U(4) * s)
        signs = (KSIGNS[aux & U(127)] | (KSIGNS[(aux >> U(7)) & U(127)] << U(8))
                 | (KSIGNS[(aux >> U(14)) & U(127)] << U(16)) | (KSIGNS[(aux >> U(21)) & U(127)] << U(24)))
        q = o + U(2) + U(8) * s
        g = GRID_IQ3_XXS
        _expand32(v, U(32) * s, _pair(g, row[q], row[q + U(1)]), _pair(g, row[q + U(2)], row[q + U(3)]),
                  _pair(g, row[q + U(4)], row[q + U(5)]), _pair(g, row[q + U(6)], row[q + U(7)]), signs)
        ls[U(2) * s] = ls[U(2) * s + U(1)] = I32(aux >> U(28))
    return _u16(row, o)


@njit(inline="always")
def _decode_iq3_s(row, o, v, ls, vd):
    """IQ3_S: grid byte + 1 high bit from qh, a sign byte per 8; ls per 32."""
    for s in range(U(8)):
        qh = U(row[o + U(66) + s])
        q = o + U(2) + U(8) * s
        g = GRID_IQ3_S
        _expand32(v, U(32) * s,
                  _pair(g, U(row[q]) | ((qh & U(1)) << U(8)), U(row[q + U(1)]) | (((qh >> U(1)) & U(1)) << U(8))),
                  _pair(g, U(row[q + U(2)]) | (((qh >> U(2)) & U(1)) << U(8)),
                        U(row[q + U(3)]) | (((qh >> U(3)) & U(1)) << U(8))),
                  _pair(g, U(row[q + U(4)]) | (((qh >> U(4)) & U(1)) << U(8)),
                        U(row[q + U(5)]) | (((qh >> U(5)) & U(1)) << U(8))),
                  _pair(g, U(row[q + U(6)]) | (((qh >> U(6)) & U(1)) << U(8)), U(row[q + U(7)]) | ((qh >> U(7)) << U(8))),
                  _u32(row, o + U(74) + U(4) * s))
        sc = I32(row[o + U(106) + s // U(2)])
        ls[U(2) * s] = ls[U(2) * s + U(1)] = (sc >> I32(U(4) * (s & U(1)))) & I32(15)
    return _u16(row, o)


@njit(inline="always")
def _decode_tq1_0(row, o, v, ls, vd):
    """TQ1_0: digit n of byte q is (u8(q * 3^n) * 3) >> 8 (ggml's order of weights)."""
    for n in range(5):
        p = POW3[n]
        for m in range(32):
            v[U(32 * n + m)] = np.int8((((U(row[o + U(m)]) * p) & U(255)) * U(3)) >> U(8))
        for m in range(16):
            v[U(160 + 16 * n + m)] = np.int8((((U(row[o + U(32 + m)]) * p) & U(255)) * U(3)) >> U(8))
    for n in range(4):
        for m in range(4):
            v[U(240 + 4 * n + m)] = np.int8((((U(row[o + U(48 + m)]) * POW3[n]) & U(255)) * U(3)) >> U(8))
    ls[:] = I32(0)
    return _u16(row, o + U(52))


@njit(inline="always")
def _decode_tq2_0(row, o, v, ls, vd):
    """TQ2_0: 2-bit codes, byte b of each 32 holds weights b, b + 32, b + 64, b + 96."""
    for k in range(U(8)):
        base = o + U(32) * (k >> U(2))
        sh = U(2) * (k & U(3))
        for b in range(U(32)):
            v[U(32) * k + b] = np.int8((U(row[base + b]) >> sh) & U(3))
    ls[:] = I32(0)
    return _u16(row, o + U(64))


@njit(inline="always")
def _decode_iq1_s(row, o, v, ls, vd):
    """IQ1_S: per 32, 4 grid bytes + 3 high bits each, ls and the delta's sign in qh."""
    for s in range(U(8)):
        hw = U(row[o + U(34) + U(2) * s]) | (U(row[o + U(35) + U(2) * s]) << U(8))
        q = o + U(2) + U(4) * s
        _expand32(v, U(32) * s, GRID_IQ1[U(row[q]) | ((hw & U(7)) << U(8))],
                  GRID_IQ1[U(row[q + U(1)]) | (((hw >> U(3)) & U(7)) << U(8))],
                  GRID_IQ1[U(row[q + U(2)]) | (((hw >> U(6)) & U(7)) << U(8))],
                  GRID_IQ1[U(row[q + U(3)]) | (((hw >> U(9)) & U(7)) << U(8))], U(0))
        neg = np.int8(I32(1) - I32(2) * I32(hw >> U(15)))  # branch-free: see _decode's overload
        for k in range(32):
            vd[U(32) * s + U(k)] = neg
        ls[U(2) * s] = ls[U(2) * s + U(1)] = I32((hw >> U(12)) & U(7))
    return _u16(row, o)


@njit(inline="always")
def _decode_iq1_m(row, o, v, ls, vd):
    """IQ1_M: per 8, a grid byte, 3 high bits and the delta's sign in a qh nibble."""
    for s in range(U(8)):
        for g in range(U(4)):
            nib = (U(row[o + U(32) + U(2) * s + (g >> U(1))]) >> (U(4) * (g & U(1)))) & U(15)
            v8 = GRID_IQ1[U(row[o + U(4) * s + g]) | ((nib & U(7)) << U(8))]
            _expand8(v, U(32) * s + U(8) * g, v8)
            neg = np.int8(I32(1) - I32(2) * I32(nib >> U(3)))
            for k in range(8):
                vd[U(32) * s + U(8) * g + U(k)] = neg
    for h in range(U(16)):
        sc = U(row[o + U(48) + U(2) * (h >> U(2))]) | (U(row[o + U(49) + U(2) * (h >> U(2))]) << U(8))
        ls[h] = I32((sc >> (U(3) * (h & U(3)))) & U(7))
    return ((U(row[o + U(49)]) >> U(4)) | ((U(row[o + U(51)]) >> U(4)) << U(4))
            | ((U(row[o + U(53)]) >> U(4)) << U(8)) | ((U(row[o + U(55)]) >> U(4)) << U(12)))


@njit(inline="always")
def _decode_iq4_xs(row, o, v, ls, vd):
    """IQ4_XS: codes through the 16-value table; ls holds the multiplier ls - 32."""
    for s in range(U(8)):
        q = o + U(8) + U(16) * s
        for k in range(16):
            c = row[q + U(k)]
            v[U(32) * s + U(k)] = np.int8(KVALUES[c & U(15)])
            v[U(32) * s + U(16 + k)] = np.int8(KVALUES[c >> U(4)])
        ls[U(2) * s] = ls[U(2) * s + U(1)] = xs_scale(row, o, s)
    return _u16(row, o)


# one decoder per kind, chosen while typing: a kernel compiles only its own type's decoder
_DECODERS = (_decode_iq2_xxs, _decode_iq2_xs, _decode_iq2_s, _decode_iq3_xxs, _decode_iq3_s, _decode_tq1_0,
             _decode_tq2_0, _decode_iq1_s, _decode_iq1_m, _decode_iq4_xs)


def _decode(kind, row, o, v, ls, vd):
    """The super-block at byte o: values into v (int8 256), the scales into ls (int32 16, one per 16
    weights; the multiplier is 2 ls + 1); for IQ1, the grid values -1 / 0 / 1 into v and the sign of
    each weight's delta (+-1) into vd; returns d's float16 bits (d_of converts them)."""
    raise NotImplementedError("compiled code only")


@overload(_decode, inline="always")
def _decode_of_kind(kind, row, o, v, ls, vd):
    if not isinstance(kind, types.IntegerLiteral):
        raise errors.TypingError("igrid._decode: kind must be a constant")
    decode = _DECODERS[kind.literal_value]

    def impl(kind, row, o, v, ls, vd):
        return decode(row, o, v, ls, vd)
    return impl


@njit(inline="always")
def _d_of(bits):
    """float32 of float16 bits. Outside _decode's overload: Numba's inliner of overloads loses
    variables set in branches or loops (hence the decoders' branch-free signs)."""
    return f16_to_f32(np.uint8(bits & U(255)), np.uint8(bits >> U(8)))


def _c64(v):
    return ir.Constant(ir.IntType(64), v)


def _scaled_quads(builder, xv, w, sc_pair):
    """<8 x i32>: lane j = sc * (sum_{k<4} xb[4j+k] * w[4j+k]) of one 32-weight sub-block, xb = x + 128
    (unsigned), w signed (|w| <= 62, so pmaddubsw's pair sums fit int16), sc the sub-block's two
    per-16 multipliers (<2 x i16>: lanes 0-3, lanes 4-7)."""
    xb = builder.xor(xv, ir.Constant(i8(32), [-128] * 32))
    return madd16(builder, maddubs16(builder, xb, w), _pair_scales(builder, sc_pair))


def _signed_quads(builder, xv, w, sc_pair):
    """_scaled_quads with x as is: |w| times x * sign(w)."""
    u, sx = abs_sign(builder, w, xv)
    return madd16(builder, maddubs16(builder, u, sx), _pair_scales(builder, sc_pair))


def _pair_scales(builder, sc_pair):
    """<16 x i16>: the first multiplier for lanes 0-7 (weights 0-15), the second for 8-15."""
    return builder.shuffle_vector(sc_pair, sc_pair, ir.Constant(i32(16), [0] * 8 + [1] * 8))


def _block_raw(context, builder, sig_args, args, x_off, quads=_scaled_quads):
    """<8 x i32>: the super-block's scaled lanes with x + 128, summed over its 8 sub-blocks
    (args: v int8[256], sc int16[16], x int8 array; x_off: the block's offset in x)."""
    v = array_ptr(context, builder, sig_args[0], args[0])
    sc = array_ptr(context, builder, sig_args[1], args[1])
    x = array_ptr(context, builder, sig_args[2], args[2])
    acc = None
    for s in range(8):
        w = load_vec(builder, v, ir.Constant(ir.IntType(64), 32 * s), i8(32))
        xv = load_vec(builder, x, builder.add(x_off, ir.Constant(ir.IntType(64), 32 * s)), i8(32))
        pair = load_vec(builder, sc, ir.Constant(ir.IntType(64), 2 * s), ir.VectorType(ir.IntType(16), 2))
        q = quads(builder, xv, w, pair)
        acc = q if acc is None else builder.add(acc, q)
    return acc


@intrinsic
def _lanes_block(typingctx, v, sc, x, x_off, iq):
    """iq[0:8] (int32) += the super-block's 8 vec_dot lanes: lane j = sum over sub-blocks of the
    per-16 multiplier times the products of weights 4j .. 4j + 3 with x at x[x_off:] (exact)."""
    sig = types.none(v, sc, x, types.uint64, iq)

    def codegen(context, builder, signature, args):
        lanes = _block_raw(context, builder, signature.args, args, args[3], _signed_quads)
        ip = builder.bitcast(array_ptr(context, builder, signature.args[4], args[4]), i32(8).as_pointer())
        builder.store(builder.add(builder.load(ip, align=4), lanes), ip, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _block_s1(typingctx, v, sc, x, x_off, corr):
    """int32: the super-block's exact scaled sum with x at x[x_off:] (the lanes above, summed)."""
    sig = types.int32(v, sc, x, types.uint64, corr)

    def codegen(context, builder, signature, args):
        raw = _block_raw(context, builder, signature.args, args, args[3])
        cp = builder.bitcast(array_ptr(context, builder, signature.args[4], args[4]), i32(8).as_pointer())
        lanes = builder.sub(raw, builder.load(cp, align=4))
        return builder.call(llvm_fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [i32(8)]), [lanes])

    return sig, codegen


@intrinsic
def _block_s1x4(typingctx, v, sc, x, x_off, stride, corr, s1):
    """s1[0:4] (int32) = _block_s1 for four tokens at x_off + k * stride, the weights loaded once."""
    sig = types.none(v, sc, x, types.uint64, types.uint64, corr, s1)

    def codegen(context, builder, signature, args):
        vp = array_ptr(context, builder, signature.args[0], args[0])
        scp = array_ptr(context, builder, signature.args[1], args[1])
        xp = array_ptr(context, builder, signature.args[2], args[2])
        offs = [args[3]]
        for _ in range(3):
            offs.append(builder.add(offs[-1], args[4]))
        accs = [None] * 4
        for s in range(8):
            at = ir.Constant(ir.IntType(64), 32 * s)
            w = load_vec(builder, vp, at, i8(32))
            pair = load_vec(builder, scp, ir.Constant(ir.IntType(64), 2 * s), ir.VectorType(ir.IntType(16), 2))
            for k in range(4):
                q = _scaled_quads(builder, load_vec(builder, xp, builder.add(offs[k], at), i8(32)), w, pair)
                accs[k] = q if accs[k] is None else builder.add(accs[k], q)
        corr = builder.load(builder.bitcast(array_ptr(context, builder, signature.args[5], args[5]),
                                            i32(8).as_pointer()), align=4)
        sums = reduce4(builder, [builder.sub(a, corr) for a in accs])
        out = builder.bitcast(array_ptr(context, builder, signature.args[6], args[6]), i32(4).as_pointer())
        builder.store(sums, out, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _w16_sums(builder, wp, xp, offs):
    """[<16 x i32>] per token: the pair products of the super-block's scaled int16 weights (at wp)
    and the int8 x at each offset, one vpdpwssd (or portable IR) per 32 weights and token."""
    i16x32 = ir.VectorType(ir.IntType(16), 32)
    v16 = ir.VectorType(ir.IntType(32), 16)
    accs = [ir.Constant(v16, [0] * 16)] * len(offs)
    for s in range(8):
        w = load_vec(builder, wp, _c64(32 * s), i16x32)
        for k, off in enumerate(offs):
            xv = builder.sext(load_vec(builder, xp, builder.add(off, _c64(32 * s)), i8(32)), i16x32)
            if ZMM_VNNI:
                fn = llvm_fn(builder, "llvm.x86.avx512.vpdpwssd.512", v16, [v16] * 3)
                accs[k] = builder.call(fn, [accs[k], builder.bitcast(w, v16), builder.bitcast(xv, v16)])
            else:
                prod = builder.mul(builder.sext(w, i32(32)), builder.sext(xv, i32(32)))
                pairs = builder.add(builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(0, 32, 2)))),
                                    builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(1, 32, 2)))))
                accs[k] = builder.add(accs[k], pairs)
    return accs


@intrinsic
def _w16_row4(typingctx, w16, d0, nb, x, x_off, xd, xd_off, out):
    """out[0:4] (float32) = the tiled product of one row with four tokens: per super-block j,
    res = d0[j] * f32(s1), acc = fma(res, d_x, acc), j in order. w16: the row's nb decoded blocks
    (int16, weights times multipliers); token k's x at x_off + k * nb * 256, its d_x at
    xd[xd_off + k * nb + j]."""
    sig = types.none(w16, d0, types.uint64, x, types.uint64, xd, types.uint64, out)

    def codegen(context, builder, signature, args):
        wp = array_ptr(context, builder, signature.args[0], args[0])
        dp = array_ptr(context, builder, signature.args[1], args[1])
        xp = array_ptr(context, builder, signature.args[3], args[3])
        xdp = array_ptr(context, builder, signature.args[5], args[5])
        nb = args[2]
        f4 = ir.VectorType(ir.FloatType(), 4)
        acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(f4, [0.0] * 4))
        xstride = builder.mul(nb, _c64(256))
        with cgutils.for_range(builder, nb) as loop:
            j = loop.index
            offs = [builder.add(args[4], builder.mul(j, _c64(256)))]
            for _ in range(3):
                offs.append(builder.add(offs[-1], xstride))
            accs = _w16_sums(builder, builder.gep(wp, [builder.mul(j, _c64(256))]), xp, offs)
            halves = [builder.add(builder.shuffle_vector(a, a, ir.Constant(i32(8), list(range(8)))),
                                  builder.shuffle_vector(a, a, ir.Constant(i32(8), list(range(8, 16))))) for a in accs]
            s1 = reduce4(builder, halves)
            xd4 = ir.Constant(f4, ir.Undefined)
            for k in range(4):
                xi = builder.add(builder.add(args[6], j), builder.mul(nb, _c64(k)))
                xd4 = builder.insert_element(xd4, builder.load(builder.gep(xdp, [xi])), ir.Constant(ir.IntType(32), k))
            d = builder.load(builder.gep(dp, [j]))
            dv = builder.insert_element(ir.Constant(f4, ir.Undefined), d, ir.Constant(ir.IntType(32), 0))
            dv = builder.shuffle_vector(dv, dv, ir.Constant(i32(4), [0] * 4))
            res = builder.fmul(dv, builder.sitofp(s1, f4))
            fma = llvm_fn(builder, "llvm.fma.v4f32", f4, [f4, f4, f4])
            builder.store(builder.call(fma, [res, xd4, builder.load(acc_ptr)]), acc_ptr)
        op = builder.bitcast(array_ptr(context, builder, signature.args[7], args[7]), f4.as_pointer())
        builder.store(builder.load(acc_ptr), op, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _w16_s1(typingctx, w16, x, x_off):
    """int32: the exact scaled sum of one super-block (w16: int16 256, each weight times its
    multiplier) with one token's x at x_off."""
    sig = types.int32(w16, x, types.uint64)

    def codegen(context, builder, signature, args):
        accs = _w16_sums(builder, array_ptr(context, builder, signature.args[0], args[0]),
                         array_ptr(context, builder, signature.args[1], args[1]), [args[2]])
        red = llvm_fn(builder, "llvm.vector.reduce.add.v16i32", ir.IntType(32), [ir.VectorType(ir.IntType(32), 16)])
        return builder.call(red, [accs[0]])

    return sig, codegen


@intrinsic
def _corr_lanes(typingctx, v, sc, corr):
    """corr[0:8] (int32) = the lanes of the super-block with x = 0, i.e. of 128 * its weights: what
    taking x + 128 adds to every lane."""
    sig = types.none(v, sc, corr)

    def codegen(context, builder, signature, args):
        zx = ir.Constant(i8(32), [0] * 32)
        v = array_ptr(context, builder, signature.args[0], args[0])
        sc = array_ptr(context, builder, signature.args[1], args[1])
        acc = None
        for s in range(8):
            w = load_vec(builder, v, ir.Constant(ir.IntType(64), 32 * s), i8(32))
            pair = load_vec(builder, sc, ir.Constant(ir.IntType(64), 2 * s), ir.VectorType(ir.IntType(16), 2))
            q = _scaled_quads(builder, zx, w, pair)
            acc = q if acc is None else builder.add(acc, q)
        cp = builder.bitcast(array_ptr(context, builder, signature.args[2], args[2]), i32(8).as_pointer())
        builder.store(acc, cp, align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- one token, IQ3_S and IQ2_XXS: decode and products in one pass (ggml's vec_dot, fused) -------
KSIGNS8 = KSIGNS.astype(np.uint8)


def _byte(builder, base, off):
    return builder.zext(builder.load(builder.gep(base, [off])), ir.IntType(32))


def _sign_x(builder, xv, signs32):
    """x with the sign of each weight applied: bit i of signs32 (i32) negates x[i]."""
    sb = builder.bitcast(signs32, i8(4))
    spread = builder.shuffle_vector(sb, sb, ir.Constant(i32(32), [i // 8 for i in range(32)]))
    neg = builder.icmp_unsigned("!=", builder.and_(spread, ir.Constant(i8(32), [1 << (i % 8) for i in range(32)])),
                                ir.Constant(i8(32), [0] * 32))
    return builder.select(neg, builder.sub(ir.Constant(i8(32), [0] * 32), xv), xv)


def _mag_quads(builder, mag, sx, mul):
    """<8 x i32>: mul (i32) times the quad sums of mag (unsigned grid magnitudes) * sx."""
    return madd16(builder, maddubs16(builder, mag, sx), splat(builder, builder.trunc(mul, ir.IntType(16)), i16(16)))


@intrinsic
def _fused_lanes(typingctx, kind, row, o, grid, ksigns, x, x_off, iq):
    """iq[0:8] (int32) += the vec_dot lanes of the IQ3_S (kind 4) or IQ2_XXS (kind 0) super-block at
    byte o of row with x at x[x_off:], decoded on the way (the same integers as _lanes_block)."""
    if not isinstance(kind, types.IntegerLiteral) or kind.literal_value not in (0, 4):
        return None
    k = kind.literal_value
    sig = types.none(kind, row, types.uint64, grid, ksigns, x, types.uint64, iq)

    def codegen(context, builder, signature, args):
        rp = array_ptr(context, builder, signature.args[1], args[1])
        gp = array_ptr(context, builder, signature.args[3], args[3])
        kp = array_ptr(context, builder, signature.args[4], args[4])
        xp = array_ptr(context, builder, signature.args[5], args[5])
        o = args[2]
        i32t = ir.IntType(32)
        acc = None
        for s in range(8):
            xv = load_vec(builder, xp, builder.add(args[6], _c64(32 * s)), i8(32))
            if k == 4:  # IQ3_S: 8 entries of 4 values; index = qs byte | bit m of qh << 8
                qh = _byte(builder, rp, builder.add(o, _c64(66 + s)))
                qs = builder.zext(load_vec(builder, rp, builder.add(o, _c64(2 + 8 * s)), i8(8)), i32(8))
                qhv = builder.insert_element(ir.Constant(i32(8), ir.Undefined), qh, ir.Constant(i32t, 0))
                qhv = builder.shuffle_vector(qhv, qhv, ir.Constant(i32(8), [0] * 8))
                hi = builder.and_(builder.shl(qhv, ir.Constant(i32(8), [8 - m for m in range(8)])),
                                  ir.Constant(i32(8), [256] * 8))
                idx = builder.or_(qs, hi)
                g = ir.Constant(i32(8), ir.Undefined)  # 8 loads: a vpgatherdd was not faster on Zen 5
                for m in range(8):
                    im = builder.extract_element(idx, ir.Constant(i32t, m))
                    val = builder.load(builder.gep(gp, [builder.zext(im, ir.IntType(64))]))
                    g = builder.insert_element(g, val, ir.Constant(i32t, m))
                mag = builder.bitcast(g, i8(32))
                sp = builder.bitcast(builder.gep(rp, [builder.add(o, _c64(74 + 4 * s))]), i32t.as_pointer())
                signs = builder.load(sp, align=1)
                sc = _byte(builder, rp, builder.add(o, _c64(106 + s // 2)))
                ls = builder.and_(builder.lshr(sc, ir.Constant(i32t, 4 * (s % 2))), ir.Constant(i32t, 15))
            else:  # IQ2_XXS: 4 grid bytes, then 4 x 7 sign-index bits and ls in one u32
                g = ir.Constant(ir.VectorType(ir.IntType(64), 4), ir.Undefined)
                for m in range(4):
                    idx = _byte(builder, rp, builder.add(o, _c64(2 + 8 * s + m)))
                    val = builder.load(builder.gep(gp, [builder.zext(idx, ir.IntType(64))]))
                    g = builder.insert_element(g, val, ir.Constant(i32t, m))
                mag = builder.bitcast(g, i8(32))
                ap = builder.bitcast(builder.gep(rp, [builder.add(o, _c64(6 + 8 * s))]), i32t.as_pointer())
                aux = builder.load(ap, align=1)
                signs = ir.Constant(i32t, 0)
                for m in range(4):
                    si = builder.and_(builder.lshr(aux, ir.Constant(i32t, 7 * m)), ir.Constant(i32t, 127))
                    sv = builder.zext(builder.load(builder.gep(kp, [builder.zext(si, ir.IntType(64))])), i32t)
                    signs = builder.or_(signs, builder.shl(sv, ir.Constant(i32t, 8 * m)))
                ls = builder.lshr(aux, ir.Constant(i32t, 28))
            mul = builder.add(builder.shl(ls, ir.Constant(i32t, 1)), ir.Constant(i32t, 1))
            q = _mag_quads(builder, mag, _sign_x(builder, xv, signs), mul)
            acc = q if acc is None else builder.add(acc, q)
        ip = builder.bitcast(array_ptr(context, builder, signature.args[7], args[7]), i32(8).as_pointer())
        builder.store(builder.add(builder.load(ip, align=4), acc), ip, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def _matvec_fused(kind, raw, xq, xd, out, grid):
    """One token of IQ3_S / IQ2_XXS: ggml's vec_dot order, each block decoded in registers."""
    n_rows = out.shape[1]
    nb = U(xd.size)
    size = U(BYTES[kind])
    mult = F32(MULT[kind])
    for c in prange((n_rows + 15) // 16):
        iq = np.zeros(8, I32)
        acc = np.empty(8, F32)
        for r in range(c * 16, min(c * 16 + 16, n_rows)):
            row = raw[r]
            acc[:] = F32(0.0)
            for j in range(nb):
                o = U(j) * size
                _fused_lanes(kind, row, o, grid, KSIGNS8, xq, U(j) * U(256), iq)
                fma_ints(f16_to_f32(row[o], row[o + U(1)]) * xd[j], iq, acc)
            out[0, r] = mult * hsum8(acc)


@njit(inline="always")
def _decode_block(kind, row, o, v, ls, sc, vd):
    """_decode, plus the per-16 multipliers sc (int16 16: 2 ls + 1, 1 for TQ); returns d."""
    d = _d_of(_decode(kind, row, o, v, ls, vd))
    for h in range(16):
        sc[h] = np.int16(ls[h] if kind == 9 else I32(2) * ls[h] + I32(1))
    return d


@njit(inline="always")
def _tiled_w16(kind, raw, xq, xd, out):
    """The tiled order with 512-bit VNNI: 16 rows decoded at a time into int16 weights times
    multipliers, then every four tokens over them while their x is in the L1 cache."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    size = U(BYTES[kind])
    mult = F32(MULT[kind])
    for c in prange((n_rows + 15) // 16):
        r0, r1 = c * 16, min(c * 16 + 16, n_rows)
        v = np.empty(256, np.int8)
        vd = np.empty(256, np.int8)
        ls = np.empty(16, I32)
        sc = np.empty(16, np.int16)
        w16 = np.empty((16, nb * U(256)), np.int16)
        d0 = np.empty((16, nb), F32)
        o4 = np.empty(4, F32)
        for r in range(r0, r1):
            row = raw[r]
            for j in range(nb):
                d0[r - r0, j] = F32(_decode_block(kind, row, U(j) * size, v, ls, sc, vd) * mult)
                if kind == 7 or kind == 8:  # llama.cpp's tiled IQ1 codes: 8 * grid + delta sign, d / 8
                    for k in range(256):
                        v[k] = np.int8(I32(8) * I32(v[k]) + I32(vd[k]))
                for k in range(256):
                    w16[r - r0, U(j) * U(256) + U(k)] = np.int16(I32(v[k]) * I32(sc[k // 16]))
        for t in range(0, n_tok - 3, 4):
            for r in range(r0, r1):
                _w16_row4(w16[r - r0], d0[r - r0], nb, xq, U(t) * nb * U(256), xd, U(t) * nb, o4)
                for k in range(4):
                    out[t + k, r] = o4[k]
        for t in range(n_tok - n_tok % 4, n_tok):
            for r in range(r0, r1):
                acc = F32(0.0)
                for j in range(nb):
                    b = U(t) * nb + U(j)
                    s1 = _w16_s1(w16[r - r0, U(j) * U(256):], xq, b * U(256))
                    acc = fma32(d0[r - r0, j] * F32(s1), xd[b], acc)
                out[t, r] = acc


@njit(inline="always")
def _product(kind, raw, xq, xd, xs, out):
    """out (n_tok, n_rows) = raw's rows times the tokens' "q8_k" parts, in llama.cpp's order for
    the batch size; rows by chunks of 16, each super-block decoded once for every token."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    size = U(BYTES[kind])
    mult = F32(MULT[kind])
    tiled = n_tok >= TILED_MIN and (kind < 5 or kind == 7 or kind == 8)
    if tiled and W16:
        _tiled_w16(kind, raw, xq, xd, out)
        return
    for c in prange((n_rows + 15) // 16):
        v = np.empty(256, np.int8)
        vd = np.empty(256, np.int8)
        ls = np.empty(16, I32)
        sc = np.empty(16, np.int16)
        corr = np.empty(8, I32)
        iq = np.zeros(8, I32)
        iq2 = np.zeros(8, I32)
        s4 = np.empty(4, I32)
        acc = np.empty((n_tok, 8), F32)
        acc2 = np.empty((n_tok, 8), F32)  # IQ1: the delta term (IQ1_S: a scalar in lane 0)
        for r in range(c * 16, min(c * 16 + 16, n_rows)):
            row = raw[r]
            acc[:] = F32(0.0)
            acc2[:] = F32(0.0)
            for j in range(nb):
                dw = _decode_block(kind, row, U(j) * size, v, ls, sc, vd)
                d0 = F32(dw * mult)
                t0 = 0
                if tiled:
                    if kind == 7 or kind == 8:  # llama.cpp's tiled IQ1 codes: 8 * grid + delta sign, d / 8
                        for k in range(256):
                            v[k] = np.int8(I32(8) * I32(v[k]) + I32(vd[k]))
                    _corr_lanes(v, sc, corr)  # x is taken as x + 128 (unsigned): the lanes of 128 * w
                    for t in range(0, n_tok - 3, 4):
                        b = U(t) * nb + U(j)
                        _block_s1x4(v, sc, xq, b * U(256), nb * U(256), corr, s4)
                        for k in range(4):
                            bk = b + U(k) * nb
                            acc[t + k, 0] = fma32(d0 * F32(s4[k]), xd[bk], acc[t + k, 0])
                    t0 = n_tok - n_tok % 4
                for t in range(t0, n_tok):
                    b = U(t) * nb + U(j)
                    if tiled:
                        s1 = _block_s1(v, sc, xq, b * U(256), corr)
                        acc[t, 0] = fma32(d0 * F32(s1), xd[b], acc[t, 0])
                        continue
                    _lanes_block(v, sc, xq, b * U(256), iq)
                    if kind == 5 or kind == 6:  # codes are weight + 1: less x's sums of 16
                        for k in range(8):
                            iq[k] -= xs[U(16) * b + U(2 * k)] + xs[U(16) * b + U(2 * k + 1)]
                    fma_ints(dw * xd[b], iq, acc[t])
                    if kind == 7 or kind == 8:  # the deltas' lanes (IQ1_M), or their sum (IQ1_S, ggml's scalar)
                        _lanes_block(vd, sc, xq, b * U(256), iq2)
                        if kind == 8:
                            fma_ints(dw * xd[b], iq2, acc2[t])
                        else:
                            s1 = I32(0)
                            for k in range(8):
                                s1 += iq2[k]
                                iq2[k] = I32(0)
                            acc2[t, 0] = fma32(xd[b] * dw, F32(s1), acc2[t, 0])
            for t in range(n_tok):
                if tiled:
                    out[t, r] = acc[t, 0]
                elif kind == 7:
                    out[t, r] = hsum8(acc[t]) + F32(0.125) * acc2[t, 0]
                elif kind == 8:
                    out[t, r] = hsum8(acc[t]) + F32(0.125) * hsum8(acc2[t])
                else:
                    out[t, r] = mult * hsum8(acc[t])


@njit(inline="always")
def _dequantize(kind, raw, out):
    """w = (db * |grid|) * sign, db as gguf.quants computes it (float32 steps)."""
    size = U(BYTES[kind])
    for r in prange(raw.shape[0]):
        v = np.empty(256, np.int8)
        vd = np.empty(256, np.int8)
        ls = np.empty(16, I32)
        row, dst = raw[r], out[r]
        for j in range(U(out.shape[1] // 256)):
            d = _d_of(_decode(kind, row, j * size, v, ls, vd))
            for h in range(16):
                if kind == 7 or kind == 8:  # w = (d * (2 ls + 1)) * (grid + delta), delta = +-1/8
                    dl = d * F32(I32(2) * ls[h] + I32(1))
                    for k in range(16):
                        dst[j * U(256) + U(16 * h + k)] = dl * (F32(v[16 * h + k]) + F32(0.125) * F32(vd[16 * h + k]))
                    continue
                if kind >= 5:
                    for k in range(16):
                        dst[j * U(256) + U(16 * h + k)] = d * F32(I32(v[16 * h + k]) - I32(1))
                    continue
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
    _product(0, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_iq2_xs(raw, xq, xd, xs, xm, out):
    _product(1, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_iq2_s(raw, xq, xd, xs, xm, out):
    _product(2, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_iq3_xxs(raw, xq, xd, xs, xm, out):
    _product(3, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_iq3_s(raw, xq, xd, xs, xm, out):
    _product(4, raw, xq, xd, xs, out)


@njit(**JIT)
def matvec_iq2_xxs(raw, xq, xd, xs, xm, out):
    _matvec_fused(0, raw, xq, xd, out.reshape(1, out.size), GRID_IQ2_XXS)


@njit(**JIT)
def matvec_iq2_xs(raw, xq, xd, xs, xm, out):
    _product(1, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq2_s(raw, xq, xd, xs, xm, out):
    _product(2, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq3_xxs(raw, xq, xd, xs, xm, out):
    _product(3, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq3_s(raw, xq, xd, xs, xm, out):
    _matvec_fused(4, raw, xq, xd, out.reshape(1, out.size), GRID_IQ3_S)


@njit(**JIT)
def dequantize_tq1_0(raw, out, lanes):
    _dequantize(5, raw, out)


@njit(**JIT)
def dequantize_tq2_0(raw, out, lanes):
    _dequantize(6, raw, out)


@njit(**JIT)
def matmul_tq1_0(raw, xq, xd, xs, xm, out):
    _product(5, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_tq2_0(raw, xq, xd, xs, xm, out):
    _product(6, raw, xq, xd, xs, out)


@njit(**JIT)
def matvec_tq1_0(raw, xq, xd, xs, xm, out):
    _product(5, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def matvec_tq2_0(raw, xq, xd, xs, xm, out):
    _product(6, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def dequantize_iq1_s(raw, out, lanes):
    _dequantize(7, raw, out)


@njit(**JIT)
def dequantize_iq1_m(raw, out, lanes):
    _dequantize(8, raw, out)


@njit(**JIT)
def matmul_iq1_s(raw, xq, xd, xs, xm, out):
    _product(7, raw, xq, xd, xs, out)


@njit(**JIT)
def matmul_iq1_m(raw, xq, xd, xs, xm, out):
    _product(8, raw, xq, xd, xs, out)


@njit(**JIT)
def matvec_iq1_s(raw, xq, xd, xs, xm, out):
    _product(7, raw, xq, xd, xs, out.reshape(1, out.size))


@njit(**JIT)
def matvec_iq1_m(raw, xq, xd, xs, xm, out):
    _product(8, raw, xq, xd, xs, out.reshape(1, out.size))


KERNELS = {
    GGMLType.IQ2_XXS: (dequantize_iq2_xxs, matvec_iq2_xxs),
    GGMLType.IQ2_XS: (dequantize_iq2_xs, matvec_iq2_xs),
    GGMLType.IQ2_S: (dequantize_iq2_s, matvec_iq2_s),
    GGMLType.IQ3_XXS: (dequantize_iq3_xxs, matvec_iq3_xxs),
    GGMLType.IQ3_S: (dequantize_iq3_s, matvec_iq3_s),
    GGMLType.TQ1_0: (dequantize_tq1_0, matvec_tq1_0),
    GGMLType.TQ2_0: (dequantize_tq2_0, matvec_tq2_0),
    GGMLType.IQ1_S: (dequantize_iq1_s, matvec_iq1_s),
    GGMLType.IQ1_M: (dequantize_iq1_m, matvec_iq1_m),
}
MATMUL = {GGMLType.IQ2_XXS: matmul_iq2_xxs, GGMLType.IQ2_XS: matmul_iq2_xs, GGMLType.IQ2_S: matmul_iq2_s,
          GGMLType.IQ3_XXS: matmul_iq3_xxs, GGMLType.IQ3_S: matmul_iq3_s, GGMLType.TQ1_0: matmul_tq1_0,
          GGMLType.TQ2_0: matmul_tq2_0, GGMLType.IQ1_S: matmul_iq1_s, GGMLType.IQ1_M: matmul_iq1_m}
