"""The prompt products' tiles: a weight row (or two) unpacked once and multiplied with several
tokens, each token keeping its own accumulators, so every (row, token) result is the one-token
row dot product's, bit for bit.

    sbdot1 / sbdot4 (+ _min): exact integer sums of unpacked K-quant super-blocks, 1 or 4 tokens
    tile8_corr / tile8_min: a K-quant row times eight tokens in llama.cpp's tiled float order
    rowdot4_q4_1u / rowdot4_q8_0 / rowdot4_q5_1 / rowdot8_q5_0 / rowdot1_q5_1: legacy rows, n tokens
    rowdot2xn_q8_0: two Q8_0 rows x four or eight tokens with VNNI (Q8_0_GROUP)
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import VNNI, ZMM_VNNI
from edgellm.kernels.cpu.ir.builder import (F32_T, I64_T, V8F, abs_sign, array_ptr, const, dpbusd, fma, fold16, hsum8,
                                            i16, i32, i8, llvm_fn, load_half, load_vec, madd16, nibbles, pair_splat,
                                            quad_sums, reduce8, splat)
from edgellm.kernels.cpu.ir.legacy import bits_spread
from edgellm.kernels.cpu.ir.kquants import pair_scaled

def sbdot_tile(n_tok, with_min):
    """Exact integer sums of K-quant super-blocks unpacked to unsigned codes, for n_tok tokens:

        sbdot(wq, w_off, sc, s_off, cm, c_off, xq, x_off, x_stride, xs, xs_off, xs_stride)
        s1[t] = sum_{i<256} sc[s_off + i // 2] * wq[w_off + i] * xq[x_off + t x_stride + i]
                + sum_{g<16} cm[c_off + g] * xs[xs_off + t xs_stride + g]
        s2[t] = sum_{g<16} cm[c_off + 16 + g] * xs[...]       (with_min only)

    wq uint8 codes in 0..63, sc int16 (one scale per pair of weights), cm int16 (per group of
    16: the correction for the codes' offset, then the min), xq int8, xs int32 (x's sums per 16,
    |xs| < 2^15). Returns (s1[0], .., s1[n-1], then s2[..] with mins); codes, scales and
    corrections are loaded once for the n_tok tokens."""
    n_ret = n_tok * (2 if with_min else 1)

    @intrinsic
    def sbdot(typingctx, wq, w_off, sc, s_off, cm, c_off, xq, x_off, x_stride, xs, xs_off, xs_stride):
        ret = types.UniTuple(types.int32, n_ret) if n_ret > 1 else types.int32
        u64 = types.uint64
        sig = ret(wq, u64, sc, u64, cm, u64, xq, u64, u64, xs, u64, u64)

        def codegen(context, builder, signature, args):
            (wq_, w_off_, sc_, s_off_, cm_, c_off_, xq_, x_off_, x_stride_, xs_, xs_off_, xs_stride_) = args
            wp = array_ptr(context, builder, signature.args[0], wq_)
            sp = array_ptr(context, builder, signature.args[2], sc_)
            cp = array_ptr(context, builder, signature.args[4], cm_)
            xp = array_ptr(context, builder, signature.args[6], xq_)
            gp = array_ptr(context, builder, signature.args[9], xs_)
            reduce = llvm_fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [i32(8)])
            xo = [builder.add(x_off_, builder.mul(const(t), x_stride_)) for t in range(n_tok)]
            go = [builder.add(xs_off_, builder.mul(const(t), xs_stride_)) for t in range(n_tok)]
            xs16 = [builder.trunc(load_vec(builder, gp, go[t], i32(16)), i16(16)) for t in range(n_tok)]
            corr = load_vec(builder, cp, c_off_, i16(16))
            sums = [madd16(builder, corr, xs16[t]) for t in range(n_tok)]
            for c in range(8):
                w = load_vec(builder, wp, builder.add(w_off_, const(32 * c)), i8(32))
                s = load_vec(builder, sp, builder.add(s_off_, const(16 * c)), i16(16))
                for t in range(n_tok):
                    y = load_vec(builder, xp, builder.add(xo[t], const(32 * c)), i8(32))
                    sums[t] = builder.add(sums[t], pair_scaled(builder, w, y, s))
            results = [builder.call(reduce, [v]) for v in sums]
            if with_min:
                mins = load_vec(builder, cp, builder.add(c_off_, const(16)), i16(16))
                results += [builder.call(reduce, [madd16(builder, mins, xs16[t])]) for t in range(n_tok)]
            return context.make_tuple(builder, ret, results) if n_ret > 1 else results[0]

        return sig, codegen

    return sbdot


sbdot1 = sbdot_tile(1, False)


sbdot4 = sbdot_tile(4, False)


sbdot1_min = sbdot_tile(1, True)


sbdot4_min = sbdot_tile(4, True)


def _low_halves(builder, sc):
    """<32 x i16>: sc[2j] then 0 for each pair j of pair scales sc (one scale per four codes, as
    every K-quant's groups of 16 or 32 have): as int32 lanes, the scale sign-free in the low half."""
    lanes = builder.bitcast(sc, i32(16))
    return builder.bitcast(builder.and_(lanes, ir.Constant(i32(16), [0xFFFF] * 16)), i16(32))


def _quads_scaled(builder, acc, u8, s8, sc):
    """<16 x i32>: acc + lane j's scale * sum_{k<4} u8[4j+k] s8[4j+k] of <64 x i8> u8 / s8, the
    scales from _low_halves (ZMM_VNNI only). The quad sums (|sum| <= 4 * 63 * 128 < 2^15) are
    one vpdpbusd; read as int16 pairs (the sum, its sign extension) they meet (scale, 0) in one
    vpdpwssd, so the scale costs no multiply of its own: two multiplies per 64 codes instead of
    the four of pmaddubsw + pmaddwd at 256 bits."""
    vi = i32(16)
    quads = dpbusd(builder, ir.Constant(vi, [0] * 16), u8, s8)
    fn = llvm_fn(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [vi] * 3)
    return builder.call(fn, [ir.Constant(vi, [0] * 16) if acc is None else acc, quads, builder.bitcast(sc, vi)])


def tile8_row(with_corr, with_min):
    """A row of a K-quant matrix unpacked as for sbdot_tile, times eight tokens, every
    super-block in llama.cpp's tiled float order (see ktiled.matmul_tiled), the eight tokens as
    the lanes of one vector:

        tile8(wq, sc, cm, k0, dw, dm, xq, x_off, x_stride, xsT, xdT, g_off, nb) -> 8 x float32

    super-block j of the row is unpacked super-block k0 + j (wq[256 k..], sc[128 k..], cm[32 k..],
    dw[k], dm[k]); token t's x block j at xq[x_off + t x_stride + 256 j]; xsT (int16) the eight
    tokens' sums per 16, at g_off * 16 + 128 j + 16 p + 2 t + h = group 2p + h of token t; xdT
    (float32) the tokens' scales at g_off + 8 j + t. with_corr: s1 gains sum cm[g] xs[g] (the
    codes' offset); with_min: s2 = sum cm[16 + g] xs[g]."""
    @intrinsic
    def tile8(typingctx, wq, sc, cm, k0, dw, dm, xq, x_off, x_stride, xsT, xdT, g_off, nb):
        ret = types.UniTuple(types.float32, 8)
        u64 = types.uint64
        sig = ret(wq, sc, cm, u64, dw, dm, xq, u64, u64, xsT, xdT, u64, u64)

        def codegen(context, builder, signature, args):
            (wq_, sc_, cm_, k0_, dw_, dm_, xq_, x_off_, x_stride_, xsT_, xdT_, g_off_, nb_) = args
            a = signature.args
            wp, sp, cp = (array_ptr(context, builder, a[i], v) for i, v in ((0, wq_), (1, sc_), (2, cm_)))
            dwp, dmp = array_ptr(context, builder, a[4], dw_), array_ptr(context, builder, a[5], dm_)
            xp, gp, dp = (array_ptr(context, builder, a[i], v) for i, v in ((6, xq_), (9, xsT_), (10, xdT_)))
            xo = [builder.add(x_off_, builder.mul(const(t), x_stride_)) for t in range(8)]
            g16 = builder.mul(g_off_, const(16))
            acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8))
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                k = builder.add(k0_, j)
                w0, s0, c0 = builder.mul(k, const(256)), builder.mul(k, const(128)), builder.mul(k, const(32))
                xj = builder.mul(j, const(256))
                sums = [None] * 8
                if ZMM_VNNI:
                    for c in range(4):
                        w = load_vec(builder, wp, builder.add(w0, const(64 * c)), i8(64))
                        s = _low_halves(builder, load_vec(builder, sp, builder.add(s0, const(32 * c)), i16(32)))
                        for t in range(8):
                            y = load_vec(builder, xp, builder.add(builder.add(xo[t], xj), const(64 * c)), i8(64))
                            sums[t] = _quads_scaled(builder, sums[t], w, y, s)
                    sums = [fold16(builder, v) for v in sums]
                else:
                    for c in range(8):
                        w = load_vec(builder, wp, builder.add(w0, const(32 * c)), i8(32))
                        s = load_vec(builder, sp, builder.add(s0, const(16 * c)), i16(16))
                        for t in range(8):
                            y = load_vec(builder, xp, builder.add(builder.add(xo[t], xj), const(32 * c)), i8(32))
                            p = pair_scaled(builder, w, y, s)
                            sums[t] = p if sums[t] is None else builder.add(sums[t], p)
                s1 = reduce8(builder, sums)
                gj = builder.add(g16, builder.mul(j, const(128)))
                xs = [load_vec(builder, gp, builder.add(gj, const(16 * p)), i16(16)) for p in range(8)] \
                    if (with_corr or with_min) else None

                def groups(first):
                    v = None
                    for p in range(8):
                        m = madd16(builder, xs[p], pair_splat(builder, cp, builder.add(c0, const(first + 2 * p))))
                        v = m if v is None else builder.add(v, m)
                    return v

                if with_corr:
                    s1 = builder.add(s1, groups(0))
                res = builder.fmul(splat(builder, builder.load(builder.gep(dwp, [k])), V8F), builder.sitofp(s1, V8F))
                if with_min:
                    s2 = builder.sitofp(groups(16), V8F)
                    dm = builder.fneg(builder.load(builder.gep(dmp, [k])))
                    res = fma(builder, splat(builder, dm, V8F), s2, res)
                xd = load_vec(builder, dp, builder.add(g_off_, builder.mul(j, const(8))), V8F)
                builder.store(fma(builder, res, xd, builder.load(acc_ptr)), acc_ptr)
            acc = builder.load(acc_ptr)
            vals = [builder.extract_element(acc, ir.Constant(ir.IntType(32), t)) for t in range(8)]
            return context.make_tuple(builder, ret, vals)

        return sig, codegen

    return tile8


tile8_corr = tile8_row(True, False)


tile8_min = tile8_row(False, True)


# --- four tokens at a time ---------------------------------------------------------------------
# The prompt products: a row's blocks are unpacked once and multiplied with four tokens' blocks,
# each token keeping its own accumulators, so every (row, token) result is the one-token row dot
# product above, bit for bit, at a fraction of the unpacking.
TILE = 4


# "q4_1u": a Q4_1 block unpacked for the prompt products (legacy.unpack_q4_1_rows): d and m as
# float32, then the 32 codes one per byte, so the tiles passing over it skip the f16 conversions
# and the nibble split
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "q4_1u": 40}


def _legacy_weights(builder, wp, o, kind):
    """(d, m or None, weights <32 x i8>, signed?) of the legacy block at byte o: unsigned q for
    Q4_1 / Q5_1 (multiplied as u8 x s8), signed q for Q8_0 and Q5_0 (q - 16, as ggml builds it)."""
    if kind == "q4_1u":
        dm = load_vec(builder, wp, o, i8(8))
        pair = builder.bitcast(dm, ir.VectorType(F32_T, 2))
        return (builder.extract_element(pair, ir.Constant(ir.IntType(32), 0)),
                builder.extract_element(pair, ir.Constant(ir.IntType(32), 1)),
                load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 8)), i8(32)), False)
    d0 = load_half(builder, wp, o)
    if kind == "q4_1":
        m0 = load_half(builder, wp, builder.add(o, ir.Constant(I64_T, 2)))
        return d0, m0, nibbles(builder, wp, builder.add(o, ir.Constant(I64_T, 4))), False
    if kind == "q8_0":
        return d0, None, load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 2)), i8(32)), True
    if kind == "q5_1":  # d, m, qh, qs: the 5th bit adds 16
        m0 = load_half(builder, wp, builder.add(o, ir.Constant(I64_T, 2)))
        qh = load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 4)), ir.IntType(32))
        nib = nibbles(builder, wp, builder.add(o, ir.Constant(I64_T, 8)))
        high = builder.select(bits_spread(builder, qh), ir.Constant(i8(32), [16] * 32), ir.Constant(i8(32), [0] * 32))
        return d0, m0, builder.or_(nib, high), False
    qh = load_vec(builder, wp, builder.add(o, ir.Constant(I64_T, 2)), ir.IntType(32))
    nib = nibbles(builder, wp, builder.add(o, ir.Constant(I64_T, 6)))
    high = builder.select(bits_spread(builder, qh), ir.Constant(i8(32), [0] * 32), ir.Constant(i8(32), [0xF0] * 32))
    return d0, None, builder.or_(nib, high), True


def _legacy_tile(kind, n_tok=TILE):
    """A legacy-type row dot product for n_tok tokens at once (a float32 for one token, else a
    tuple): xq block i of token t at x_off + t * x_stride + 32 i; its scale d_x (xd) and Q8_1 sum
    s_x (xm) at b_off + n_tok i + t, the tokens' values interleaved (interleave_blocks), so a
    block's d_w * d_x and fma(m_w, s_x, summs) are one n_tok-lane op each for all the tokens.
    Every lane does what the one-token code does: each result is rowdot_<kind>'s, bit for bit."""
    size = _BLOCK_BYTES[kind]
    lanes = ir.VectorType(F32_T, n_tok)
    m0_used = kind in ("q4_1", "q4_1u", "q5_1")

    @intrinsic
    def rowdot_tile(typingctx, w, w_off, xq, x_off, x_stride, xd, xm, b_off, nb):
        ret = types.UniTuple(types.float32, n_tok) if n_tok > 1 else types.float32
        sig = ret(w, types.uint64, xq, types.uint64, types.uint64, xd, xm, types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            w_, w_off_, xq_, x_off_, x_stride_, xd_, xm_, b_off_, nb_ = args
            wp = array_ptr(context, builder, signature.args[0], w_)
            xp = array_ptr(context, builder, signature.args[2], xq_)
            dp = array_ptr(context, builder, signature.args[5], xd_)
            mp = array_ptr(context, builder, signature.args[6], xm_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(n_tok)]
            sums = cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * n_tok))
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                o = builder.add(w_off_, builder.mul(i, const(size)))
                d0, m0, qx, signed = _legacy_weights(builder, wp, o, kind)
                ax = abs_sign(builder, qx, qx)[0] if signed else qx
                bo = builder.add(b_off_, builder.mul(i, const(n_tok)))
                dd = builder.fmul(splat(builder, d0, lanes), load_vec(builder, dp, bo, lanes))
                if m0 is not None:
                    builder.store(fma(builder, splat(builder, m0, lanes), load_vec(builder, mp, bo, lanes),
                                       builder.load(sums)), sums)
                for t in range(n_tok):
                    xo = builder.add(builder.add(x_off_, builder.mul(const(t), x_stride_)), builder.mul(i, const(32)))
                    qy = load_vec(builder, xp, xo, i8(32))
                    sy = abs_sign(builder, qx, qy)[1] if signed else qy
                    xy = builder.sitofp(quad_sums(builder, ax, sy), V8F)
                    ddt = builder.shuffle_vector(dd, dd, ir.Constant(i32(8), [t] * 8))
                    builder.store(fma(builder, ddt, xy, builder.load(accs[t])), accs[t])
            sv = builder.load(sums)
            results = []
            for t in range(n_tok):
                r = hsum8(builder, builder.load(accs[t]))
                if m0_used:
                    r = builder.fadd(r, builder.extract_element(sv, ir.Constant(ir.IntType(32), t)))
                results.append(r)
            return context.make_tuple(builder, ret, results) if n_tok > 1 else results[0]

        return sig, codegen

    return rowdot_tile


def _q8_0_two_rows(n_tok, per_vec):
    """Two Q8_0 rows times n_tok tokens (2 n_tok float32: row 0's tokens, then row 1's), each
    result rowdot_q8_0's bit for bit:

        tile(w, w_off0, w_off1, xg, x_off, corr, xd, b_off, nb) -> 2 n_tok x float32

    The weights go in as unsigned bytes w + 128 and each lane's integer sum starts from -128 x the
    token's four activations (corr, once per batch: legacy.q8_0_group_inputs), so the activations
    need no per-row sign fix (as vpdpbusd's u8 x s8 form otherwise takes) and both rows share every
    activation load: per row, token and block one vpdpbusd, one int-to-float, one multiply and one
    fma. per_vec tokens a vector: 2 (512-bit, ZMM_VNNI) or 1 (256-bit, VNNI). xg: per block the
    group's n_tok x 32 codes side by side, block i of the group at x_off + 32 n_tok i; corr: eight
    int32 a token and block, at 8 (b_off + n_tok i + t); xd: b_off + n_tok i + t."""
    lanes = 8 * per_vec
    vf, vi = ir.VectorType(F32_T, lanes), i32(lanes)
    n_vec = n_tok // per_vec
    dup = ir.Constant(i32(32 * per_vec), list(range(32)) * per_vec)
    flip = ir.Constant(i8(32), [-128] * 32)

    @intrinsic
    def tile(typingctx, w, w_off0, w_off1, xg, x_off, corr, xd, b_off, nb):
        u64 = types.uint64
        sig = types.UniTuple(types.float32, 2 * n_tok)(w, u64, u64, xg, u64, corr, xd, u64, u64)

        def codegen(context, builder, signature, args):
            w_, w_off0_, w_off1_, xg_, x_off_, corr_, xd_, b_off_, nb_ = args
            wp = array_ptr(context, builder, signature.args[0], w_)
            xp = array_ptr(context, builder, signature.args[3], xg_)
            cp = array_ptr(context, builder, signature.args[5], corr_)
            dp = array_ptr(context, builder, signature.args[6], xd_)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(n_vec)]
                    for _ in range(2)]
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                bo = builder.add(b_off_, builder.mul(i, const(n_tok)))
                xdn = load_vec(builder, dp, bo, ir.VectorType(F32_T, n_tok))
                wu, dd = [], []
                for off in (w_off0_, w_off1_):
                    o = builder.add(off, builder.mul(i, const(34)))
                    q = builder.xor(load_vec(builder, wp, builder.add(o, const(2)), i8(32)), flip)
                    wu.append(builder.shuffle_vector(q, q, dup) if per_vec > 1 else q)
                    d0 = splat(builder, load_half(builder, wp, o), ir.VectorType(F32_T, n_tok))
                    dd.append(builder.fmul(d0, xdn))
                xo = builder.add(x_off_, builder.mul(i, const(32 * n_tok)))
                for v in range(n_vec):
                    xv = load_vec(builder, xp, builder.add(xo, const(32 * per_vec * v)), i8(32 * per_vec))
                    cv = load_vec(builder, cp, builder.add(builder.mul(bo, const(8)), const(lanes * v)), vi)
                    sel = ir.Constant(i32(lanes), [per_vec * v + h for h in range(per_vec) for _ in range(8)])
                    for r in range(2):
                        xy = builder.sitofp(dpbusd(builder, cv, wu[r], xv), vf)
                        ddv = builder.shuffle_vector(dd[r], dd[r], sel)
                        builder.store(fma(builder, ddv, xy, builder.load(accs[r][v])), accs[r][v])
            results = []
            for r in range(2):
                for v in range(n_vec):
                    acc = builder.load(accs[r][v])
                    for h in range(per_vec):
                        part = builder.shuffle_vector(acc, acc, ir.Constant(i32(8), list(range(8 * h, 8 * h + 8))))
                        results.append(hsum8(builder, part))
            return context.make_tuple(builder, signature.return_type, results)

        return sig, codegen

    return tile


# Q8_0 batches: two rows x eight tokens in 512-bit vectors with AVX-512 VNNI, two rows x four in
# 256-bit ones with VNNI alone (AVX-VNNI); without VNNI the sign-fix tiles of _legacy_tile
Q8_0_GROUP = 8 if ZMM_VNNI else 4 if VNNI else 0


rowdot2xn_q8_0 = _q8_0_two_rows(8, 2) if ZMM_VNNI else _q8_0_two_rows(4, 1)


rowdot4_q4_1u = _legacy_tile("q4_1u")


rowdot4_q8_0 = _legacy_tile("q8_0")


rowdot4_q5_1 = _legacy_tile("q5_1")


rowdot8_q5_0 = _legacy_tile("q5_0", 8)


rowdot1_q5_1 = _legacy_tile("q5_1", 1)  # one token (x_stride unused)
