"""Dot products of a K-quant weight row (Q2_K, Q3_K, Q5_K, Q6_K) with a Q8_K activation row, in
ggml's x86 order, one intrinsic per row (Q4_K's one-row kernel is plain @njit code in
kquants.py; its eight-row forms are in rows8 and packed):

    rowdot_q<k>_k(w, w_off, xq, x_off, xd, xs, b_off, nb) -> float32
    rowdotx2_q6_k / rowdotx4_q6_k(w, w_off, xq, x_off, xd, xs, b_off, nb, out, out_off, out_stride)
        # two / four tokens, each token's steps rowdot_q6_k's (the same bits), codes unpacked once

xs: the Q8_K sums per 16 values; the super-block scales are applied in ggml's order.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import AVX2
from edgellm.kernels.cpu.ir.builder import (F32_T, I32_T, I64_T, V8F, array_ptr, block_loop, const, fma, hsum8, i8,
                                            i16, i32, llvm_fn, load_half, load_vec, madd16, maddubs16, prefetch_row,
                                            splat)

def _scaled_quads(builder, u8, s8, sc0, sc1):
    """<8 x i32>: lane j = sc(j) * sum_{k<4} u8[4j+k] * s8[4j+k], sc = sc0 for lanes 0..3
    (bytes 0..15), sc1 for 4..7; u8 in 0..63 (pair sums fit int16): pmaddubsw, then pmaddwd
    with the scales."""
    sc = builder.shuffle_vector(splat(builder, builder.trunc(sc0, ir.IntType(16)), i16(16)),
                                splat(builder, builder.trunc(sc1, ir.IntType(16)), i16(16)),
                                ir.Constant(i32(16), list(range(8)) + list(range(24, 32))))
    return pair_scaled(builder, u8, s8, sc)


def pair_scaled(builder, u8, s8, sc):
    """<8 x i32>: lane j = sc[2j] * (u8[4j] s8[4j] + u8[4j+1] s8[4j+1]) + sc[2j+1] * (the next
    pair); sc <16 x i16>, one scale per pair of bytes; u8 in 0..63 (pair sums fit int16)."""
    if AVX2:
        p16 = builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", i16(16), [i8(32), i8(32)]), [u8, s8])
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", i32(8), [i16(16), i16(16)]), [p16, sc])
    prod = builder.mul(builder.zext(u8, i32(32)), builder.sext(s8, i32(32)))
    pairs = builder.add(builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(0, 32, 2)))),
                        builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(1, 32, 2)))))
    pairs = builder.mul(pairs, builder.sext(sc, i32(16)))
    return builder.add(builder.shuffle_vector(pairs, pairs, ir.Constant(i32(8), list(range(0, 16, 2)))),
                       builder.shuffle_vector(pairs, pairs, ir.Constant(i32(8), list(range(1, 16, 2)))))


def _q6_k_codes(builder, wp, o, sc16):
    """The Q6_K super-block at byte o as eight steps of 32 weights: (step, the unsigned 6-bit codes
    <32 x i8> (low 4 bits from ql, high 2 from qh), their scales as pmaddwd pairs from sc16)."""
    for h in range(2):
        qh = load_vec(builder, wp, builder.add(o, const(128 + 32 * h)), i8(32))
        ql = [load_vec(builder, wp, builder.add(o, const(64 * h + 32 * k)), i8(32)) for k in (0, 1)]
        for t in range(4):
            lo = ql[t % 2] if t < 2 else builder.lshr(ql[t % 2], ir.Constant(i8(32), [4] * 32))
            lo = builder.and_(lo, ir.Constant(i8(32), [15] * 32))
            hi = builder.and_(builder.shl(qh, ir.Constant(i8(32), [4 - 2 * t] * 32)) if t < 2 else
                              builder.lshr(qh, ir.Constant(i8(32), [2 * t - 4] * 32)),
                              ir.Constant(i8(32), [48] * 32))
            g = 8 * h + 2 * t
            yield 4 * h + t, builder.or_(lo, hi), builder.shuffle_vector(
                sc16, sc16, ir.Constant(i32(16), [g] * 8 + [g + 1] * 8))


@intrinsic
def rowdot_q6_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q6_K row (210-byte super-blocks: ql[128], qh[64], scales i8[16], d) times x in
    Q8_K form (xs: sums per 16), in ggml's order: per super-block eight int32 lanes (lane j: the
    unsigned 6-bit q times x of weights 4j..4j+3 of every 32, scaled), minus lane j's share of the
    offset 32 * (sc[2j] xs[2j] + sc[2j+1] xs[2j+1]); then acc = fma(d_x * d_w, lanes, acc) and
    hsum_float_8."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)
        sp = array_ptr(context, builder, signature.args[5], xs_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(210)))
            prefetch_row(builder, wp, o, 210)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            # the 16 scales once as <16 x i16>; each 32-weight group's pair of them by a shuffle
            sc16 = builder.sext(load_vec(builder, wp, builder.add(o, const(192)), i8(16)), i16(16))
            sumi = ir.Constant(i32(8), [0] * 8)
            for step, q, sc in _q6_k_codes(builder, wp, o, sc16):
                y = load_vec(builder, xp, builder.add(xo, const(32 * step)), i8(32))
                sumi = builder.add(sumi, pair_scaled(builder, q, y, sc))
            # the -32 of every weight, per lane: 32 * (sc[2l] * xs[2l] + sc[2l+1] * xs[2l+1])
            # (xs: sums of 16 int8 values, |xs| <= 2048, exact in int16)
            s16 = builder.mul(builder.add(b_off_, i), const(16))
            xs16 = builder.trunc(load_vec(builder, sp, s16, i32(16)), i16(16))
            offs = builder.shl(madd16(builder, sc16, xs16), ir.Constant(i32(8), [5] * 8))
            sumi = builder.sub(sumi, offs)
            d = builder.fmul(builder.load(builder.gep(dp, [builder.add(b_off_, i)])),
                             load_half(builder, wp, builder.add(o, const(208))))
            acc = fma(builder, splat(builder, d, V8F), builder.sitofp(sumi, V8F), acc)
            return acc, s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen


def _rowdotn_q6_k(n_tok: int):
    """rowdot_q6_k for n_tok tokens at once: rowdotn(w, w_off, xq, x_off, xd, xs, b_off, nb, out,
    out_off, out_stride), token t's Q8_K blocks at b_off + t nb (its values at x_off + 256 t nb),
    its result at out[out_off + t out_stride]. Each token's steps are rowdot_q6_k's, so each result
    is rowdot_q6_k's bit for bit; the row's codes are unpacked once for all of them."""
    u64 = types.uint64

    @intrinsic
    def rowdotn_q6_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb, out, out_off, out_stride):
        sig = types.void(w, u64, xq, u64, xd, xs, u64, u64, out, u64, u64)

        def codegen(context, builder, signature, args):
            w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_, out_, out_off_, out_stride_ = args
            wp = array_ptr(context, builder, signature.args[0], w_)
            xp = array_ptr(context, builder, signature.args[2], xq_)
            dp = array_ptr(context, builder, signature.args[4], xd_)
            sp = array_ptr(context, builder, signature.args[5], xs_)
            op = array_ptr(context, builder, signature.args[8], out_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(n_tok)]
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                o = builder.add(w_off_, builder.mul(i, const(210)))
                prefetch_row(builder, wp, o, 210)
                sc16 = builder.sext(load_vec(builder, wp, builder.add(o, const(192)), i8(16)), i16(16))
                dw = load_half(builder, wp, builder.add(o, const(208)))
                sumi = [ir.Constant(i32(8), [0] * 8)] * n_tok
                for step, q, sc in _q6_k_codes(builder, wp, o, sc16):
                    for k in range(n_tok):
                        xo = builder.add(x_off_, builder.mul(builder.add(builder.mul(const(k), nb_), i), const(256)))
                        y = load_vec(builder, xp, builder.add(xo, const(32 * step)), i8(32))
                        sumi[k] = builder.add(sumi[k], pair_scaled(builder, q, y, sc))
                for k in range(n_tok):
                    bi = builder.add(b_off_, builder.add(builder.mul(const(k), nb_), i))
                    xs16 = builder.trunc(load_vec(builder, sp, builder.mul(bi, const(16)), i32(16)), i16(16))
                    offs = builder.shl(madd16(builder, sc16, xs16), ir.Constant(i32(8), [5] * 8))
                    d = builder.fmul(builder.load(builder.gep(dp, [bi])), dw)
                    acc = fma(builder, splat(builder, d, V8F), builder.sitofp(builder.sub(sumi[k], offs), V8F),
                               builder.load(accs[k]))
                    builder.store(acc, accs[k])
            for k in range(n_tok):
                at = builder.add(out_off_, builder.mul(const(k), out_stride_))
                builder.store(hsum8(builder, builder.load(accs[k])), builder.gep(op, [at]))
            return context.get_dummy_value()

        return sig, codegen

    return rowdotn_q6_k


# one-token-order Q6_K rows for two and four tokens (a verification step's rows)
rowdotx2_q6_k, rowdotx4_q6_k = _rowdotn_q6_k(2), _rowdotn_q6_k(4)


def _k_scale_min(builder, wp, o, b):
    """(scale, min) as int32 of sub-block b (0..7) of a Q4_K / Q5_K super-block whose 12 packed
    6-bit scale bytes start at byte o."""
    def byte(k):
        return builder.zext(builder.load(builder.gep(wp, [builder.add(o, ir.Constant(I64_T, k))])), ir.IntType(32))

    def c(v):
        return ir.Constant(ir.IntType(32), v)

    if b < 4:
        return builder.and_(byte(b), c(63)), builder.and_(byte(b + 4), c(63))
    sc = builder.or_(builder.and_(byte(b + 4), c(15)), builder.shl(builder.lshr(byte(b - 4), c(6)), c(4)))
    mn = builder.or_(builder.lshr(byte(b + 4), c(4)), builder.shl(builder.lshr(byte(b), c(6)), c(4)))
    return sc, mn


def k_scales(builder, wp, o):
    """<16 x i16>: the eight 6-bit scales then the eight mins of the Q4_K / Q5_K super-block at byte
    o, unpacked in one 128-bit vector: the 12 scale bytes as words u0 u1 u2 (and 4 bytes of the
    codes after them, unused), lanes [sc 0-3, sc 4-7, mn 0-3, mn 4-7] = [u0 & 3F, (u2 & 0F) |
    (u0 >> 2 & 30), u1 & 3F, (u2 >> 4 & 0F) | (u1 >> 2 & 30)] per byte (ggml's get_scale_min_k4)."""
    def c4(vals):
        return ir.Constant(i32(4), vals)

    v = load_vec(builder, wp, builder.add(o, const(4)), i32(4))
    a = builder.shuffle_vector(v, v, c4([0, 2, 1, 2]))  # u0 u2 u1 u2
    b = builder.shuffle_vector(v, v, c4([0, 0, 1, 1]))  # u0 u0 u1 u1
    low = builder.and_(builder.lshr(a, c4([0, 0, 0, 4])), c4([0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    high = builder.and_(builder.lshr(b, c4([2, 2, 2, 2])), c4([0, 0x30303030, 0, 0x30303030]))
    return builder.zext(builder.bitcast(builder.or_(low, high), i8(16)), i16(16))


@intrinsic
def rowdot_q5_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q5_K row (176-byte super-blocks: d, dmin, scales[12], qh[32], qs[128]) times x in
    Q8_K form, in ggml's x86 order: per super-block eight int32 lanes (lane j: weights 4j..4j+3 of
    every 32, times their sub-block's scale), acc = fma(d_x * d_w, lanes, acc); the mins apart,
    summs = fma(-d_x * dmin_w, sum of min * (x sums), summs); result hsum_float_8(acc) + summs."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)
        sp = array_ptr(context, builder, signature.args[5], xs_)

        def body(i, acc, summs):
            o = builder.add(w_off_, builder.mul(i, const(176)))
            prefetch_row(builder, wp, o, 176)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            bi = builder.add(b_off_, i)
            qh = load_vec(builder, wp, builder.add(o, const(16)), i8(32))
            sm = k_scales(builder, wp, o)  # <16 x i16>: the eight scales, then the eight mins
            sumi = ir.Constant(i32(8), [0] * 8)
            for c in range(4):
                qs = load_vec(builder, wp, builder.add(o, const(48 + 32 * c)), i8(32))
                for half in range(2):
                    b = 2 * c + half
                    lo = builder.and_(qs if half == 0 else builder.lshr(qs, ir.Constant(i8(32), [4] * 32)),
                                      ir.Constant(i8(32), [15] * 32))
                    hi = (builder.shl(qh, ir.Constant(i8(32), [4 - b] * 32)) if b < 4 else
                          builder.lshr(qh, ir.Constant(i8(32), [b - 4] * 32)))
                    q = builder.or_(lo, builder.and_(hi, ir.Constant(i8(32), [16] * 32)))
                    y = load_vec(builder, xp, builder.add(xo, const(32 * b)), i8(32))
                    sc = builder.shuffle_vector(sm, sm, ir.Constant(i32(16), [b] * 16))
                    sumi = builder.add(sumi, pair_scaled(builder, q, y, sc))
            # the mins: sum_b m_b (xs[2b] + xs[2b+1]) (xs: sums of 16 int8 values, exact in int16)
            xs16 = builder.trunc(load_vec(builder, sp, builder.mul(bi, const(16)), i32(16)), i16(16))
            mins = builder.shuffle_vector(sm, sm, ir.Constant(i32(16), [8 + k // 2 for k in range(16)]))
            mv = madd16(builder, mins, xs16)
            msum = builder.call(llvm_fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [i32(8)]), [mv])
            dx = builder.load(builder.gep(dp, [bi]))
            d = builder.fmul(dx, load_half(builder, wp, o))
            dmin = builder.fmul(builder.fneg(dx), load_half(builder, wp, builder.add(o, const(2))))
            acc = fma(builder, splat(builder, d, V8F), builder.sitofp(sumi, V8F), acc)
            summs = fma(builder, dmin, builder.sitofp(msum, F32_T), summs)
            return acc, summs

        acc, summs = block_loop(context, builder, nb_, body)
        return builder.fadd(hsum8(builder, acc), summs)

    return sig, codegen


@intrinsic
def rowdot_q2_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q2_K row (84-byte super-blocks: scales[16] (sc | min << 4), qs[64], d, dmin)
    times x in Q8_K form, in ggml's x86 order: per super-block first
    acc = fma(-d_x * dmin_w, lanes of min * (x sums), acc) (lane k: groups 2k and 2k+1), then
    acc = fma(d_x * d_w, lanes of sc * q * x, acc) (lane j: weights 4j..4j+3 of every 32); the
    result hsum_float_8(acc)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)
        sp = array_ptr(context, builder, signature.args[5], xs_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(84)))
            prefetch_row(builder, wp, o, 84)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            bi = builder.add(b_off_, i)
            s16 = builder.mul(bi, const(16))
            scb = [builder.zext(builder.load(builder.gep(wp, [builder.add(o, const(k))])), I32_T) for k in range(16)]
            sc = [builder.and_(b, ir.Constant(I32_T, 15)) for b in scb]
            mn = [builder.lshr(b, ir.Constant(I32_T, 4)) for b in scb]
            mins = ir.Constant(i32(8), [0] * 8)
            for lane in range(8):
                v = builder.add(builder.mul(mn[2 * lane], builder.load(builder.gep(sp, [builder.add(s16, const(2 * lane))]))),
                                builder.mul(mn[2 * lane + 1],
                                            builder.load(builder.gep(sp, [builder.add(s16, const(2 * lane + 1))]))))
                mins = builder.insert_element(mins, v, ir.Constant(I32_T, lane))
            dx = builder.load(builder.gep(dp, [bi]))
            d = builder.fmul(dx, load_half(builder, wp, builder.add(o, const(80))))
            dmin = builder.fmul(builder.fneg(dx), load_half(builder, wp, builder.add(o, const(82))))
            acc = fma(builder, splat(builder, dmin, V8F), builder.sitofp(mins, V8F), acc)
            sumi = ir.Constant(i32(8), [0] * 8)
            for j in range(2):
                bits = load_vec(builder, wp, builder.add(o, const(16 + 32 * j)), i8(32))
                for k in range(4):
                    q = builder.and_(builder.lshr(bits, ir.Constant(i8(32), [2 * k] * 32)), ir.Constant(i8(32), [3] * 32))
                    y = load_vec(builder, xp, builder.add(xo, const(128 * j + 32 * k)), i8(32))
                    g = 8 * j + 2 * k
                    sumi = builder.add(sumi, _scaled_quads(builder, q, y, sc[g], sc[g + 1]))
            acc = fma(builder, splat(builder, d, V8F), builder.sitofp(sumi, V8F), acc)
            return acc, s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen


@intrinsic
def rowdot_q3_k(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q3_K row (110-byte super-blocks: hmask[32], qs[64], scales[12], d) times x in
    Q8_K form, in ggml's x86 order: per super-block eight int32 lanes (lane j: sc * q * x of
    weights 4j..4j+3 of every 32, q = low 2 bits - 4 unless the hmask bit is set), then
    acc = fma(d_x * d_w, lanes, acc); the result hsum_float_8(acc)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)

        def byte(o, k):
            return builder.zext(builder.load(builder.gep(wp, [builder.add(o, const(k))])), I32_T)

        def bits(v, shift, mask):
            return builder.and_(builder.lshr(v, ir.Constant(I32_T, shift)), ir.Constant(I32_T, mask))

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(110)))
            prefetch_row(builder, wp, o, 110)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            # the 16 6-bit scales as <16 x i16>, from scales[12]: low nibbles of bytes 0..7 then
            # their high nibbles; 2 high bits from bytes 8..11, shifted by 2 (g // 4)
            b8 = builder.bitcast(builder.load(builder.bitcast(builder.gep(wp, [builder.add(o, const(96))]),
                                                              ir.IntType(64).as_pointer()), align=1), i8(8))
            b4 = builder.bitcast(builder.load(builder.bitcast(builder.gep(wp, [builder.add(o, const(104))]),
                                                              I32_T.as_pointer()), align=1), i8(4))
            lo = builder.shuffle_vector(b8, builder.lshr(b8, ir.Constant(i8(8), [4] * 8)),
                                        ir.Constant(i32(16), list(range(16))))
            lo = builder.and_(lo, ir.Constant(i8(16), [15] * 16))
            parts = [builder.lshr(b4, ir.Constant(i8(4), [2 * k] * 4)) for k in range(4)]
            hi = builder.shuffle_vector(builder.shuffle_vector(parts[0], parts[1], ir.Constant(i32(8), list(range(8)))),
                                        builder.shuffle_vector(parts[2], parts[3], ir.Constant(i32(8), list(range(8)))),
                                        ir.Constant(i32(16), list(range(16))))
            hi = builder.shl(builder.and_(hi, ir.Constant(i8(16), [3] * 16)), ir.Constant(i8(16), [4] * 16))
            sc16 = builder.sub(builder.sext(builder.or_(lo, hi), i16(16)), ir.Constant(i16(16), [32] * 16))
            hmask = load_vec(builder, wp, o, i8(32))
            not_h = builder.xor(hmask, ir.Constant(i8(32), [-1] * 32))
            sumi = ir.Constant(i32(8), [0] * 8)
            for c in range(2):
                qbits = load_vec(builder, wp, builder.add(o, const(32 + 32 * c)), i8(32))
                for s_ in range(4):
                    low = builder.and_(qbits if s_ == 0 else builder.lshr(qbits, ir.Constant(i8(32), [2 * s_] * 32)),
                                       ir.Constant(i8(32), [3] * 32))
                    k = 4 * c + s_  # the hmask bit: 4 where it is clear
                    four = (builder.shl(not_h, ir.Constant(i8(32), [2 - k] * 32)) if k < 2 else
                            builder.lshr(not_h, ir.Constant(i8(32), [k - 2] * 32)) if k > 2 else not_h)
                    four = builder.and_(four, ir.Constant(i8(32), [4] * 32))
                    y = load_vec(builder, xp, builder.add(xo, const(128 * c + 32 * s_)), i8(32))
                    g = 8 * c + 2 * s_
                    # (low - four) . y per pair of bytes, exact in int16 (|.| <= 2 * 4 * 128)
                    p16 = builder.sub(maddubs16(builder, low, y), maddubs16(builder, four, y))
                    sc = builder.shuffle_vector(sc16, sc16, ir.Constant(i32(16), [g] * 8 + [g + 1] * 8))
                    sumi = builder.add(sumi, madd16(builder, p16, sc))
            d = builder.fmul(builder.load(builder.gep(dp, [builder.add(b_off_, i)])),
                             load_half(builder, wp, builder.add(o, const(108))))
            acc = fma(builder, splat(builder, d, V8F), builder.sitofp(sumi, V8F), acc)
            return acc, s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen
