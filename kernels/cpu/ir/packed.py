"""Rows interleaved by eight at load (a row is a vector lane), for decode and prompt products:

    il8_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off)
        # rows8_q4_k's results from eight rows packed by kquants.pack8_q4_k
    il8x2_q4_k / il8x3_q4_k / il8n4_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # il8_q4_k's results (its order) for two, three, four tokens, the weights read once
    il8x4_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # four tokens over packed rows (gemm order)
    il8x4_q4_0(codes, dws, g_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # four tokens, Q4_0 rows interleaved by legacy.interleave8_q4_0
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import SOFTWARE_PREFETCH, VNNI
from edgellm.kernels.cpu.ir.builder import (I32_T, V8F, const, dpbusd, fma, i16, i32, i8, load_vec, madd16, maddubs16,
                                            prefetch, splat)
from edgellm.kernels.cpu.ir.rows8 import row_pointers, store8

# --- Q4_K rows packed by eight: decode and prompt products with the rows in the lanes -----------
# rows8_q4_k keeps each row's sums in its own vector and reduces the eight at every super-block;
# on a 16-register AVX2 core that (with the per-row scale splats and the stack traffic of the
# loaded x) bounds it even from the cache. llama.cpp repacks Q4_K at load so a row is
# a lane (its block_q4_Kx8). kquants.pack8_q4_k writes eight rows that way once, still 4-bit:
# per super-block of the eight rows (Q4_K8_SB bytes), for pair c of sub-blocks and step s of
# four bytes, 32 bytes = the eight rows' bytes 16 + 32 c + 4 s .. + 3 (low nibbles: codes 4s..4s+3
# of sub-block 2c, high: of 2c + 1); then the rows' d and dmin (f16 lanes), their eight 6-bit
# scales as bytes [b][r] and mins as bytes [c][r][2] (unpacked: 128 bytes where the rows had 96).
# Each step is a broadcast of four x bytes and one pmaddubsw per sub-block into 16-bit lanes
# (eight steps: |sum| <= 8 * 2 * 15 * 128 < 2^15), one pmaddwd with the rows' scales per
# sub-block; lane r is row r's exact integer sum, never reduced. The float steps are the
# row kernels' (one fma per super-block for one token, per pair of sub-blocks for four), so every
# result is theirs bit for bit.
# the decode kernel prefetches (into L2) the packed super-block this many ahead, the best distance
# measured on Intel; 0 (none) where host.SOFTWARE_PREFETCH is off (docs/performance.md)
PACKED_AHEAD = 3 if SOFTWARE_PREFETCH else 0


Q4_K8_SB = 1184  # bytes per super-block of eight packed rows: 1024 codes, 16 d, 16 dmin, 64 scales, 64 mins


PACK_D, PACK_DMIN, PACK_SC, PACK_MN = 1024, 1040, 1056, 1120


def _halves_lanes(builder, wp, o):
    """<8 x float>: the eight f16 at byte o of wp."""
    h = load_vec(builder, wp, o, ir.VectorType(ir.IntType(16), 8))
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), V8F)


def _packed_steps(builder, wp, o, c, xs_at):
    """Sub-blocks 2c and 2c + 1 of a packed super-block at byte o: ([<16 x i16>] per x, for each
    of the two) the eight steps' pmaddubsw sums, x's four bytes of step s of sub-block b at
    xs_at(b, s) for each x (a list of functions, one per token)."""
    m4 = ir.Constant(i8(32), [15] * 32)
    z16 = ir.Constant(i16(16), [0] * 16)
    acc = [[z16, z16] for _ in xs_at]
    for s in range(8):
        q = load_vec(builder, wp, builder.add(o, const(256 * c + 32 * s)), i8(32))
        lo = builder.and_(q, m4)
        hi = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(q, i16(16)), ir.Constant(i16(16), [4] * 16)),
                                          i8(32)), m4)
        for t, at in enumerate(xs_at):
            for h, cv in ((0, lo), (1, hi)):
                xv = builder.bitcast(splat(builder, at(2 * c + h, s), i32(8)), i8(32))
                acc[t][h] = builder.add(acc[t][h], maddubs16(builder, cv, xv))
    return acc


def _packed_scale(builder, wp, o, b):
    """<16 x i16>: the eight rows' scales of sub-block b as (sc, sc) pairs, lane pair r = row r."""
    sc = builder.zext(load_vec(builder, wp, builder.add(o, const(PACK_SC + 8 * b)), i8(8)), i32(8))
    return builder.bitcast(builder.or_(sc, builder.shl(sc, ir.Constant(i32(8), [16] * 8))), i16(16))


def _packed_mins(builder, wp, o, c):
    """<16 x i16>: the rows' mins of sub-blocks 2c, 2c + 1 as pairs (lane pair r = row r)."""
    return builder.zext(load_vec(builder, wp, builder.add(o, const(PACK_MN + 16 * c)), i8(16)), i16(16))


def _x4(builder, xp, xo):
    return lambda b, s: load_vec(builder, xp, builder.add(xo, const(32 * b + 4 * s)), I32_T)


def _il8n_q4_k(n_tok: int):
    """Eight Q4_K rows packed at byte w_off (kquants.pack8_q4_k; super-block j at w_off +
    Q4_K8_SB j) times n_tok tokens in the one-token order (rows8_q4_k's results, bit for bit), x as
    for rows8_q4_k (Q8_K parts, xs the sums per 16): token t's super-blocks at b_off + t nb, its
    results at out_off + t out_stride. The weights' loads, nibble splits and scales are shared by
    the tokens. One token: il8_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off)."""
    u64 = types.uint64

    def typer(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride=None):
        sig = types.void(w, u64, xq, xd, xs, u64, u64, out, u64, *([u64] if n_tok > 1 else []))

        def codegen(context, builder, signature, args):
            w_off_, b_off_, nb_, out_off_ = args[1], args[5], args[6], args[8]
            out_stride_ = args[9] if n_tok > 1 else const(0)
            wp, xp, dp, sp, op = row_pointers(context, builder, signature, args, (0, 2, 3, 4, 7))
            zero = ir.Constant(V8F, [0.0] * 8)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(n_tok)]
            accms = [cgutils.alloca_once_value(builder, zero) for _ in range(n_tok)]
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                o = builder.add(w_off_, builder.mul(j, const(Q4_K8_SB)))
                if PACKED_AHEAD:
                    prefetch(builder, wp, builder.add(o, const(PACKED_AHEAD * Q4_K8_SB)), Q4_K8_SB - 64)
                its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(n_tok)]
                pairs = []
                for i in its:  # x's sums per 32, as il8_q4_k takes them
                    s16 = load_vec(builder, sp, builder.mul(i, const(16)), i32(16))
                    s32 = builder.add(builder.shuffle_vector(s16, s16, ir.Constant(i32(8), list(range(0, 16, 2)))),
                                      builder.shuffle_vector(s16, s16, ir.Constant(i32(8), list(range(1, 16, 2)))))
                    pairs.append(builder.bitcast(builder.trunc(s32, i16(8)), i32(4)))
                isum, msum = [None] * n_tok, [None] * n_tok
                for c in range(4):
                    steps = _packed_steps(builder, wp, o, c, [_x4(builder, xp, builder.mul(i, const(256))) for i in its])
                    scales = (_packed_scale(builder, wp, o, 2 * c), _packed_scale(builder, wp, o, 2 * c + 1))
                    mins = _packed_mins(builder, wp, o, c)
                    for t in range(n_tok):
                        for a16, sc in zip(steps[t], scales):
                            p = madd16(builder, a16, sc)
                            isum[t] = p if isum[t] is None else builder.add(isum[t], p)
                        xpair = splat(builder, builder.extract_element(pairs[t], ir.Constant(I32_T, c)), i32(8))
                        p = madd16(builder, mins, builder.bitcast(xpair, i16(16)))
                        msum[t] = p if msum[t] is None else builder.add(msum[t], p)
                dw = _halves_lanes(builder, wp, builder.add(o, const(PACK_D)))
                dmw = _halves_lanes(builder, wp, builder.add(o, const(PACK_DMIN)))
                for t, i in enumerate(its):
                    dx = splat(builder, builder.load(builder.gep(dp, [i])), V8F)
                    d, dmin = builder.fmul(dw, dx), builder.fmul(dmw, dx)
                    builder.store(fma(builder, builder.sitofp(isum[t], V8F), d, builder.load(accs[t])), accs[t])
                    builder.store(fma(builder, builder.sitofp(msum[t], V8F), dmin, builder.load(accms[t])), accms[t])
            for t in range(n_tok):
                res = builder.fsub(builder.load(accs[t]), builder.load(accms[t]))
                store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), res)
            return context.get_dummy_value()

        return sig, codegen

    if n_tok == 1:
        def il8_q4_k(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off):
            return typer(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off)

        return intrinsic(il8_q4_k)

    def il8n_q4_k(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride):
        return typer(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)

    return intrinsic(il8n_q4_k)


# one token (decode), and 2, 3 and 4 tokens (a verification step's rows) over packed Q4_K rows
il8_q4_k, il8x2_q4_k, il8x3_q4_k, il8n4_q4_k = (_il8n_q4_k(n) for n in (1, 2, 3, 4))


@intrinsic
def il8x4_q4_k(typingctx, w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride):
    """Eight packed Q4_K rows (at byte w_off, as for il8_q4_k) x four tokens in the order of
    llama.cpp's four-token Q4_K kernel (kquants.row_q4_k with per_pair: an fma per pair of
    sub-blocks, bit for bit): token t's super-blocks at b_off + t nb, its results at out_off +
    t out_stride. xs here: int16 sums of x per sub-block of 32 (kquants.sums32), block i's eight
    at 8 i; a pair of sub-blocks' min term is one pmaddwd for the eight rows."""
    u64 = types.uint64
    sig = types.void(w, u64, xq, xd, xs, u64, u64, out, u64, u64)

    def codegen(context, builder, signature, args):
        w_off_, b_off_, nb_, out_off_, out_stride_ = args[1], args[5], args[6], args[8], args[9]
        wp, xp, dp, gp, op = row_pointers(context, builder, signature, args, (0, 2, 3, 4, 7))
        zero = ir.Constant(V8F, [0.0] * 8)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        accms = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            o = builder.add(w_off_, builder.mul(j, const(Q4_K8_SB)))
            dw = _halves_lanes(builder, wp, builder.add(o, const(PACK_D)))
            dmw = _halves_lanes(builder, wp, builder.add(o, const(PACK_DMIN)))
            its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(4)]
            dxs = [splat(builder, builder.load(builder.gep(dp, [i])), V8F) for i in its]
            dd = [builder.fmul(dw, dx) for dx in dxs]
            dm = [builder.fmul(dmw, dx) for dx in dxs]
            ats = [_x4(builder, xp, builder.mul(i, const(256))) for i in its]
            for c in range(4):
                acc16 = _packed_steps(builder, wp, o, c, ats)
                sc_lo, sc_hi = _packed_scale(builder, wp, o, 2 * c), _packed_scale(builder, wp, o, 2 * c + 1)
                mc = _packed_mins(builder, wp, o, c)
                for t, i in enumerate(its):
                    part = builder.add(madd16(builder, acc16[t][0], sc_lo), madd16(builder, acc16[t][1], sc_hi))
                    x2 = load_vec(builder, gp, builder.add(builder.mul(i, const(8)), const(2 * c)), I32_T)
                    msum = madd16(builder, mc, builder.bitcast(splat(builder, x2, i32(8)), i16(16)))
                    builder.store(fma(builder, builder.sitofp(part, V8F), dd[t], builder.load(accs[t])), accs[t])
                    builder.store(fma(builder, builder.sitofp(msum, V8F), dm[t], builder.load(accms[t])), accms[t])
        for t in range(4):
            res = builder.fsub(builder.load(accs[t]), builder.load(accms[t]))
            store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), res)
        return context.get_dummy_value()

    return sig, codegen


IL_Q4_0 = 256  # interleaved code bytes per block of eight Q4_0 rows


@intrinsic
def il8x4_q4_0(typingctx, codes, dws, g_off, xq, xd, xs, b_off, nb, out, out_off, out_stride):
    """rows8_q4_0's results (bit for bit) for four tokens and eight Q4_0 rows interleaved at
    block g_off on (legacy.interleave8_q4_0: codes[256 g + 32 s + 4 r + q] = code 4s + q of row
    r's block, dws[8 g + r] its d): per step a broadcast of four x bytes and one pmaddubsw per token into
    16-bit lanes (eight steps: |sum| <= 8 * 2 * 15 * 128 < 2^15), then one pmaddwd per block;
    lane r is row r's sum q . x, minus 8 (x's block sum) as the one-token kernel takes it."""
    u64 = types.uint64
    sig = types.void(codes, dws, u64, xq, xd, xs, u64, u64, out, u64, u64)

    def codegen(context, builder, signature, args):
        g_off_, b_off_, nb_, out_off_, out_stride_ = args[2], args[6], args[7], args[9], args[10]
        cp, dwp, xp, dp, sp, op = row_pointers(context, builder, signature, args, (0, 1, 3, 4, 5, 8))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(4)]
        ones = ir.Constant(i16(16), [1] * 16)
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            g = builder.add(g_off_, j)
            dw = load_vec(builder, dwp, builder.mul(g, const(8)), V8F)
            its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(4)]
            # VNNI: vpdpbusd sums each step's four products straight into the 32-bit lanes
            acc = [ir.Constant(i32(8) if VNNI else i16(16), [0] * (8 if VNNI else 16))] * 4
            for s in range(8):
                w = load_vec(builder, cp, builder.add(builder.mul(g, const(IL_Q4_0)), const(32 * s)), i8(32))
                for t, i in enumerate(its):
                    x4 = load_vec(builder, xp, builder.add(builder.mul(i, const(32)), const(4 * s)), ir.IntType(32))
                    xv = builder.bitcast(splat(builder, x4, i32(8)), i8(32))
                    acc[t] = (dpbusd(builder, acc[t], w, xv) if VNNI else
                              builder.add(acc[t], maddubs16(builder, w, xv)))
            for t, i in enumerate(its):
                xs8 = builder.mul(builder.load(builder.gep(sp, [i])), ir.Constant(I32_T, 8))
                lanes = acc[t] if VNNI else madd16(builder, acc[t], ones)
                isum = builder.sub(lanes, splat(builder, xs8, i32(8)))
                d = builder.fmul(dw, splat(builder, builder.load(builder.gep(dp, [i])), V8F))
                builder.store(fma(builder, builder.sitofp(isum, V8F), d, builder.load(accs[t])), accs[t])
        for t in range(4):
            store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), builder.load(accs[t]))
        return context.get_dummy_value()

    return sig, codegen
