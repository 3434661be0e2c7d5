"""Dot products of a legacy-type weight row (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0) with an activation row,
summed in the order ggml's x86 CPU code sums them: the loop over blocks is one intrinsic emitting
LLVM vector IR.

Why: the small models edgellm targets have outlier activations that turn a float32 rounding
difference in one product into visible differences in the logits (docs/performance.md). Following
ggml's order makes a product the same bits as llama.cpp's; it is also the fast order: eight float
lanes, no horizontal sum per block.

ggml's AVX2 `vec_dot` for the legacy types, per block b of 32 weights:
    lanes (8 x int32)  lane j = sum of the integer products of weights 4j .. 4j+3 (u8 x s8
                        multiply-add pairs, then pairs of pairs: pmaddubsw + pmaddwd)
    acc  = fma(splat(d_w * d_x), float(lanes), acc)            (8 float lanes)
    Q4_1 / Q5_1 also: summs = fma(m_w, s_x, summs)            (one float, in block order)
result = ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3))  [+ summs]

Entry points (Numba intrinsics, usable inside @njit code):
    rowdot_q4_1(w, w_off, xq, x_off, xd, xm, b_off, nb) -> float32
    rowdot_q8_0(w, w_off, xq, x_off, xd, b_off, nb)     -> float32
    rowdot_q5_0(w, w_off, xq, x_off, xd, b_off, nb)     -> float32
    dot32_q4 / dot32_q5 / dot32_i8 / dot32_field: the integer sum of one block
w: uint8 weights (row at byte w_off), xq: int8 activations (block i at x_off + 32 i), xd / xm:
float32 per-block activation scale / Q8_1 sum (block i at b_off + i), nb: number of blocks.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import AVX2
from edgellm.kernels.cpu.ir.builder import (I64_T, V8F, abs_sign, array_ptr, block_loop, field, fma, hsum8, i16, i32,
                                            i8, llvm_fn, load_bytes, load_half, load_vec, nibbles, quad_sums, splat)

def _scaled_sum(builder, u8, s8, sc0, sc1):
    """int32: sc0 * sum_{j<16} u8[j] * s8[j] + sc1 * sum_{16<=j<32} ...; u8 (<32 x i8>) in
    0..127 unsigned, s8 signed, |sc| <= 128 (pair sums of products fit int16)."""
    if AVX2:
        pairs = builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", i16(16), [i8(32), i8(32)]), [u8, s8])
        scales = builder.shuffle_vector(
            splat(builder, builder.trunc(sc0, ir.IntType(16)), i16(16)),
            splat(builder, builder.trunc(sc1, ir.IntType(16)), i16(16)),
            ir.Constant(i32(16), list(range(8)) + list(range(24, 32))))
        quads = builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", i32(8), [i16(16), i16(16)]), [pairs, scales])
    else:
        prod = builder.mul(builder.zext(u8, i32(32)), builder.sext(s8, i32(32)))
        scales = builder.shuffle_vector(splat(builder, sc0, i32(32)), splat(builder, sc1, i32(32)),
                                        ir.Constant(i32(32), list(range(16)) + list(range(48, 64))))
        quads = builder.mul(prod, scales)
    n = quads.type.count
    return builder.call(llvm_fn(builder, f"llvm.vector.reduce.add.v{n}i32", ir.IntType(32), [quads.type]), [quads])


_ONE = ir.Constant(ir.IntType(32), 1)


@intrinsic
def dot32_field(typingctx, w, w_off, shift, mask, x, x_off, sc0, sc1):
    """int32 sum_{j<32} sc(j) * ((w[w_off + j] >> shift) & mask) * x[x_off + j], sc(j) = sc0 for
    j < 16 else sc1; w uint8, x int8, mask <= 127."""
    sig = types.int32(w, types.uint64, types.int32, types.int32, x, types.uint64, types.int32, types.int32)

    def codegen(context, builder, signature, args):
        wv = field(builder, load_bytes(context, builder, signature.args[0], args[0], args[1], 32), args[2], args[3])
        xv = load_bytes(context, builder, signature.args[4], args[4], args[5], 32)
        return _scaled_sum(builder, wv, xv, args[6], args[7])

    return sig, codegen


@intrinsic
def dot32_q4(typingctx, w, w_off, x, x_off):
    """int32 sum_{j<16} (w[w_off + j] & 15) * x[x_off + j] + (w[w_off + j] >> 4) * x[x_off + 16 + j]:
    the 16 nibble bytes of a Q4_0 / Q4_1 block against 32 int8 values."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        raw = load_bytes(context, builder, signature.args[0], args[0], args[1], 16)
        nib = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(i8(16), [4] * 16)),
                                     ir.Constant(i32(32), list(range(32))))
        wv = builder.and_(nib, ir.Constant(i8(32), [15] * 32))
        xv = load_bytes(context, builder, signature.args[2], args[2], args[3], 32)
        return _scaled_sum(builder, wv, xv, _ONE, _ONE)

    return sig, codegen


@intrinsic
def dot32_q5(typingctx, w, w_off, qh, x, x_off):
    """As dot32_q4 with bit j of qh (uint32) as the 5th bit of weight j (0 <= j < 32)."""
    sig = types.int32(w, types.uint64, types.uint32, x, types.uint64)

    def codegen(context, builder, signature, args):
        raw = load_bytes(context, builder, signature.args[0], args[0], args[1], 16)
        nib = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(i8(16), [4] * 16)),
                                     ir.Constant(i32(32), list(range(32))))
        # byte j // 8 of qh into lane j, tested against bit j % 8: 16 where set (shuffle + compare)
        qh_bytes = builder.bitcast(args[2], i8(4))
        spread = builder.shuffle_vector(qh_bytes, ir.Constant(i8(4), ir.Undefined),
                                        ir.Constant(i32(32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, ir.Constant(i8(32), [1 << (j % 8) for j in range(32)]))
        high = builder.select(builder.icmp_unsigned("!=", bit, ir.Constant(i8(32), [0] * 32)),
                              ir.Constant(i8(32), [16] * 32), ir.Constant(i8(32), [0] * 32))
        wv = builder.or_(builder.and_(nib, ir.Constant(i8(32), [15] * 32)), high)
        xv = load_bytes(context, builder, signature.args[3], args[3], args[4], 32)
        return _scaled_sum(builder, wv, xv, _ONE, _ONE)

    return sig, codegen


@intrinsic
def dot32_i8(typingctx, w, w_off, x, x_off):
    """int32 sum_{j<32} int8(w[w_off + j]) * x[x_off + j]; w uint8 read as int8, x int8."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        wv = load_bytes(context, builder, signature.args[0], args[0], args[1], 32)
        xv = load_bytes(context, builder, signature.args[2], args[2], args[3], 32)
        absw, sx = abs_sign(builder, wv, xv)
        return _scaled_sum(builder, absw, sx, _ONE, _ONE)

    return sig, codegen


@intrinsic
def rowdot_q4_1(typingctx, w, w_off, xq, x_off, xd, xm, b_off, nb):
    """float32: a Q4_1 row (20-byte blocks: d, m, qs[16]) times x in Q8_1 form, in ggml's order."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xm, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xm_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)
        mp = array_ptr(context, builder, signature.args[5], xm_)

        def body(i, acc, summs):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(I64_T, 20)))
            bi = builder.add(b_off_, i)
            d0 = load_half(builder, wp, o)
            m0 = load_half(builder, wp, builder.add(o, ir.Constant(I64_T, 2)))
            d1 = builder.load(builder.gep(dp, [bi]))
            s1 = builder.load(builder.gep(mp, [bi]))
            summs = fma(builder, m0, s1, summs)
            qx = nibbles(builder, wp, builder.add(o, ir.Constant(I64_T, 4)))
            qy = load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(I64_T, 32))), i8(32))
            xy = builder.sitofp(quad_sums(builder, qx, qy), V8F)
            acc = fma(builder, splat(builder, builder.fmul(d0, d1), V8F), xy, acc)
            return acc, summs

        acc, summs = block_loop(context, builder, nb_, body)
        return builder.fadd(hsum8(builder, acc), summs)

    return sig, codegen


@intrinsic
def rowdot_q8_0(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q8_0 row (34-byte blocks: d, qs[32] int8) times x in Q8_0 form, in ggml's order."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(I64_T, 34)))
            d0 = load_half(builder, wp, o)
            d1 = builder.load(builder.gep(dp, [builder.add(b_off_, i)]))
            qx = load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 2)), i8(32))
            qy = load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(I64_T, 32))), i8(32))
            ax, sy = abs_sign(builder, qx, qy)
            xy = builder.sitofp(quad_sums(builder, ax, sy), V8F)
            acc = fma(builder, splat(builder, builder.fmul(d0, d1), V8F), xy, acc)
            return acc, s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen


def bits_spread(builder, qh32):
    """<32 x i1>: bit j of the uint32 qh in lane j."""
    qh_bytes = builder.bitcast(qh32, i8(4))
    spread = builder.shuffle_vector(qh_bytes, ir.Constant(i8(4), ir.Undefined),
                                    ir.Constant(i32(32), [j // 8 for j in range(32)]))
    bit = builder.and_(spread, ir.Constant(i8(32), [1 << (j % 8) for j in range(32)]))
    return builder.icmp_unsigned("!=", bit, ir.Constant(i8(32), [0] * 32))


@intrinsic
def rowdot_q5_0(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q5_0 row (22-byte blocks: d, qh u32, qs[16]) times x in Q8_0 form, in ggml's
    order (the weights as signed q - 16, then as Q8_0)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(I64_T, 22)))
            d0 = load_half(builder, wp, o)
            d1 = builder.load(builder.gep(dp, [builder.add(b_off_, i)]))
            qh = load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 2)), ir.IntType(32))
            nib = nibbles(builder, wp, builder.add(o, ir.Constant(I64_T, 6)))
            # 5th bit clear: q - 16 = nibble - 16, i.e. the nibble with the high bits 0xF0 set
            high = builder.select(bits_spread(builder, qh), ir.Constant(i8(32), [0] * 32),
                                  ir.Constant(i8(32), [0xF0] * 32))
            qx = builder.or_(nib, high)
            qy = load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(I64_T, 32))), i8(32))
            ax, sy = abs_sign(builder, qx, qy)
            xy = builder.sitofp(quad_sums(builder, ax, sy), V8F)
            acc = fma(builder, splat(builder, builder.fmul(d0, d1), V8F), xy, acc)
            return acc, s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen
