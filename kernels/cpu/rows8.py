"""Eight weight rows times one activation row at once, for the 4-bit decode products (Q4_0, Q4_K).

The one-row kernels (legacy._row_q4_0, kquants._row_q4_k) reduce each block's integer products to
one int32 with a full horizontal sum, per row and per block: at 1B-8B widths that, not the memory,
bounds decode. Here eight rows pass over each activation block together: every row keeps its
integer products in an <8 x i32> vector, the eight vectors are summed into one (lane r = row r's
exact block sum) by a tree of pairwise adds, and the per-row float steps run as eight lanes of one
vector op. The float order is the one-row kernels' (llama.cpp's repacked 8-row x86 kernels): per
block, per row, acc = fma(float(isum), d_w * d_x, acc) in block order; integer sums are exact in any
order. So each output is the one-row kernel's, bit for bit, and eight row streams are in flight.

    rows8_q4_0(w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off)
    rows8_q4_k(w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off)
    il8x4_q4_0(codes, dws, g_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # four tokens, Q4_0 rows interleaved by legacy.interleave8_q4_0
    rows8_q5_0(w, w_off, rb, xq, x_off, xd, b_off, nb, out, out_off)   # as rows8_q8_0
    il8_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off)
        # rows8_q4_k's results from eight rows packed by kquants.pack8_q4_k
    il8x4_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # four tokens over packed rows (gemm order)
    il8x2_q4_k / il8x3_q4_k / il8n4_q4_k(w, w_off, xq, xd, xs, b_off, nb, out, out_off, out_stride)
        # il8_q4_k's results (its order) for two, three, four tokens, the weights read once

w: uint8 weights, row r (0..7) at byte w_off + r * rb; activations as in the one-row kernels
(Q8_0 "q8_32" parts with xs the block sums, or Q8_K parts with xs the 16-value sums), block i at
b_off + i; out[out_off + r] = row r's dot product.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.common import REGS32, SOFTWARE_PREFETCH, VNNI, _fn, _i8, _i16, _i32, _splat
from edgellm.kernels.cpu.rowdot import (_V8F, _dpbusd, _fma, _k_scales, _load_vec, _madd16, _prefetch, _ptr,
                                        _quad_sums, _reduce8, const)
from edgellm.kernels.cpu.rowdot import _maddubs16 as _maddubs

_I32 = ir.IntType(32)


def _halves8(builder, wp, offs):
    """<8 x float>: the f16 values at byte offsets offs (eight i64) of wp."""
    v = ir.Constant(ir.VectorType(ir.IntType(16), 8), ir.Undefined)
    for r, o in enumerate(offs):
        h = builder.load(builder.bitcast(builder.gep(wp, [o]), ir.IntType(16).as_pointer()), align=1)
        v = builder.insert_element(v, h, ir.Constant(_I32, r))
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), _V8F)


def _store8(builder, op, off, v):
    builder.store(v, builder.bitcast(builder.gep(op, [off]), _V8F.as_pointer()), align=4)


def _pointers(context, builder, signature, args, which):
    """The data pointers of the array arguments at positions `which`."""
    return [_ptr(context, builder, signature.args[k], args[k]) for k in which]


def _group(builder, w_off, rb):
    """(the eight rows' byte offsets, the offset of the group after the next: what `_ahead` reads)."""
    return ([builder.add(w_off, builder.mul(const(r), rb)) for r in range(8)],
            builder.add(w_off, builder.mul(const(16), rb)))


# The eight-row kernels prefetch the group after the next (_ahead), on every CPU: their eight rows
# are eight streams a row apart, which the hardware does not follow as well as one
# (scripts/bench/bench_decode_memory.py; docs/performance.md).
GROUP_AHEAD = True


def _ahead(builder, wp, ahead, j, block):
    """At block j of a group: prefetch the j-th stretch of eight blocks' bytes from `ahead` on (the
    group after the next, whose eight rows lie one after another), so the loop's pace reads that
    group linearly by the time it ends. Nothing where GROUP_AHEAD is off."""
    if GROUP_AHEAD:
        _prefetch(builder, wp, builder.add(ahead, builder.mul(j, const(8 * block))), 8 * block)


def _rows8(kind):
    block = {"q4_0": 18, "q4_k": 144}[kind]

    @intrinsic
    def rows8(typingctx, w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off):
        sig = types.void(w, types.uint64, types.uint64, xq, xd, xs, types.uint64, types.uint64, out, types.uint64)

        def codegen(context, builder, signature, args):
            w_off_, rb_, b_off_, nb_, out_off_ = args[1], args[2], args[6], args[7], args[9]
            wp, xp, dp, sp, op = _pointers(context, builder, signature, args, (0, 3, 4, 5, 8))
            rows, ahead = _group(builder, w_off_, rb_)
            zero = ir.Constant(_V8F, [0.0] * 8)
            acc = cgutils.alloca_once_value(builder, zero)
            acc_m = cgutils.alloca_once_value(builder, zero)
            masks = _splat_masks(builder, nb_) if kind == "q4_k" and REGS32 else None
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                i = builder.add(b_off_, j)
                _ahead(builder, wp, ahead, j, block)
                offs = [builder.add(r, builder.mul(j, const(block))) for r in rows]
                dx = _splat(builder, builder.load(builder.gep(dp, [i])), _V8F)
                if kind == "q4_0":
                    isum = _q4_0_sums(builder, _q4_0_codes(builder, wp, offs), xp, sp, i)
                    d = builder.fmul(_halves8(builder, wp, offs), dx)
                    builder.store(_fma(builder, builder.sitofp(isum, _V8F), d, builder.load(acc)), acc)
                else:
                    isum, msum = _q4_k_sums(builder, wp, offs, xp, sp, i, masks)
                    d = builder.fmul(_halves8(builder, wp, offs), dx)
                    dmin = builder.fmul(_halves8(builder, wp, [builder.add(o, const(2)) for o in offs]), dx)
                    builder.store(_fma(builder, builder.sitofp(isum, _V8F), d, builder.load(acc)), acc)
                    builder.store(_fma(builder, builder.sitofp(msum, _V8F), dmin, builder.load(acc_m)), acc_m)
            res = builder.load(acc)
            if kind == "q4_k":
                res = builder.fsub(res, builder.load(acc_m))
            _store8(builder, op, out_off_, res)
            return context.get_dummy_value()

        return sig, codegen

    return rows8


def _q4_0_codes(builder, wp, offs):
    """The eight rows' blocks as <32 x i8> codes 0..15 (16 nibble bytes after the f16 scale)."""
    codes = []
    for o in offs:
        raw = _load_vec(builder, wp, builder.add(o, const(2)), _i8(16))
        both = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(_i8(16), [4] * 16)),
                                      ir.Constant(_i32(32), list(range(32))))
        codes.append(builder.and_(both, ir.Constant(_i8(32), [15] * 32)))
    return codes


def _q4_0_sums(builder, codes, xp, sp, i):
    """<8 x i32>: row r's sum of (q - 8) x over block i of x."""
    x = _load_vec(builder, xp, builder.mul(i, const(32)), _i8(32))
    quads = [_quad_sums(builder, q, x) for q in codes]
    xs8 = builder.mul(builder.load(builder.gep(sp, [i])), ir.Constant(_I32, 8))
    return builder.sub(_reduce8(builder, quads), _splat(builder, xs8, _i32(8)))


def _q4_k_sums(builder, wp, offs, xp, sp, i, masks):
    """(<8 x i32> isum, <8 x i32> msum) of the eight rows' super-block i: sum_b sc_b (q . x)_b and
    sum_b m_b (x sums of sub-block b)."""
    xo = builder.mul(i, const(256))
    xs = [_load_vec(builder, xp, builder.add(xo, const(32 * k)), _i8(32)) for k in range(8)]
    bsums = builder.trunc(_load_vec(builder, sp, builder.mul(i, const(16)), _i32(16)), _i16(16))
    mask = ir.Constant(_i8(32), [15] * 32)
    isums, msums = [], []
    for o in offs:
        sm = _k_scales(builder, wp, o)
        mins = builder.shuffle_vector(sm, sm, ir.Constant(_i32(16), [8 + k // 2 for k in range(16)]))
        msums.append(_madd16(builder, mins, bsums))
        dup = builder.shuffle_vector(sm, sm, ir.Constant(_i32(16), list(range(8)) * 2))  # scales in both halves
        tot = None
        for c in range(4):
            q = _load_vec(builder, wp, builder.add(o, const(16 + 32 * c)), _i8(32))
            for half, qv in enumerate((builder.and_(q, mask), builder.and_(builder.lshr(q, ir.Constant(_i8(32), [4] * 32)), mask))):
                b = 2 * c + half
                sc = _word_splat(builder, dup, b, masks)
                p = _madd16(builder, _maddubs(builder, qv, xs[b]), sc)
                tot = p if tot is None else builder.add(tot, p)
        isums.append(tot)
    return _reduce8(builder, isums), _reduce8(builder, msums)


def _splat_masks(builder, nb):
    """The pshufb masks of _word_splat, one per word, made once per call from a zero LLVM cannot see
    (nb >> 40: a row of 2^48 weights is far beyond any model); with constant masks LLVM turns the
    pshufb back into its own splat, a shift and a broadcast, twice the instructions."""
    zero = _splat(builder, builder.trunc(builder.lshr(nb, const(40)), ir.IntType(8)), _i8(32))
    return [builder.add(ir.Constant(_i8(32), [2 * b, 2 * b + 1] * 16), zero) for b in range(8)]


def _word_splat(builder, dup, b, masks):
    """<16 x i16>: word b of dup (whose two 128-bit halves are alike) in every lane: one in-lane
    byte shuffle (pshufb) where the eight masks can stay in registers (32 of them); with AVX2's 16
    they would go to the stack, and LLVM's shift and broadcast is as fast."""
    if REGS32:
        fn = _fn(builder, "llvm.x86.avx2.pshuf.b", _i8(32), [_i8(32), _i8(32)])
        return builder.bitcast(builder.call(fn, [builder.bitcast(dup, _i8(32)), masks[b]]), _i16(16))
    return builder.shuffle_vector(dup, dup, ir.Constant(_i32(16), [b] * 16))


rows8_q4_0 = _rows8("q4_0")
rows8_q4_k = _rows8("q4_k")


# --- eight rows of Q8_0 -----------------------------------------------------------------------
# The one-row Q8_0 kernel (rowdot.rowdot_q8_0, ggml's vec_dot order) carries one chain of dependent
# fmas through a row's blocks (acc = fma(d_w d_x, float(lanes), acc)) and is bound by it, not by the
# memory (as fast from DRAM as from L2). Eight rows at once run eight independent chains, each row's in its own
# order, so every result is the one-row kernel's bit for bit, and each x block is loaded once for
# the eight. (The same for Q4_1 and Q5_0 was measured and not kept: no gain at 2 threads.)
def _rows8_q8_32(block: int, codes):
    """An eight-row kernel for a type whose blocks hold an f16 d first and signed codes taken
    against x in Q8_0 form: codes(builder, wp, o) -> <32 x i8> of the block at byte o. Each row's
    steps are its one-row kernel's (rowdot_q8_0 / rowdot_q5_0), x's block loaded once for eight rows."""

    @intrinsic
    def rows8(typingctx, w, w_off, rb, xq, x_off, xd, b_off, nb, out, out_off):
        sig = types.void(w, types.uint64, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64, out,
                         types.uint64)

        def codegen(context, builder, signature, args):
            from edgellm.kernels.cpu.rowdot import _abs_sign, _hsum8, _load_half

            w_off_, rb_, x_off_, b_off_, nb_, out_off_ = args[1], args[2], args[4], args[6], args[7], args[9]
            wp, xp, dp, op = _pointers(context, builder, signature, args, (0, 3, 5, 8))
            rows, ahead = _group(builder, w_off_, rb_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(8)]
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                _ahead(builder, wp, ahead, j, block)
                d1 = builder.load(builder.gep(dp, [builder.add(b_off_, j)]))
                qy = _load_vec(builder, xp, builder.add(x_off_, builder.mul(j, const(32))), _i8(32))
                for r in range(8):
                    o = builder.add(rows[r], builder.mul(j, const(block)))
                    d0 = _load_half(builder, wp, o)
                    ax, sy = _abs_sign(builder, codes(builder, wp, o), qy)
                    xy = builder.sitofp(_quad_sums(builder, ax, sy), _V8F)
                    d = _splat(builder, builder.fmul(d0, d1), _V8F)
                    builder.store(_fma(builder, d, xy, builder.load(accs[r])), accs[r])
            for r in range(8):
                builder.store(_hsum8(builder, builder.load(accs[r])),
                              builder.gep(op, [builder.add(out_off_, const(r))]))
            return context.get_dummy_value()

        return sig, codegen

    return rows8


def _q8_0_codes(builder, wp, o):
    return _load_vec(builder, wp, builder.add(o, const(2)), _i8(32))


def _q5_0_codes(builder, wp, o):
    """q - 16: the nibble with the high bits 0xF0 set where the 5th bit is clear."""
    from edgellm.kernels.cpu.rowdot import _bits_spread, _nibbles

    qh = _load_vec(builder, wp, builder.add(o, const(2)), _I32)
    return builder.or_(_nibbles(builder, wp, builder.add(o, const(6))),
                       builder.select(_bits_spread(builder, qh), ir.Constant(_i8(32), [0] * 32),
                                      ir.Constant(_i8(32), [0xF0] * 32)))


# out[out_off + r] for the rows r = 0..7 at w_off + r rb: what rowdot_q8_0 / rowdot_q5_0 gives each
# (x in Q8_0 form: xq from x_off, block i's scale xd[b_off + i])
rows8_q8_0 = _rows8_q8_32(34, _q8_0_codes)
rows8_q5_0 = _rows8_q8_32(22, _q5_0_codes)


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
# measured on Intel; 0 (none) where common.SOFTWARE_PREFETCH is off (docs/performance.md)
PACKED_AHEAD = 3 if SOFTWARE_PREFETCH else 0
Q4_K8_SB = 1184  # bytes per super-block of eight packed rows: 1024 codes, 16 d, 16 dmin, 64 scales, 64 mins
_P_D, _P_DMIN, _P_SC, _P_MN = 1024, 1040, 1056, 1120


def _halves_lanes(builder, wp, o):
    """<8 x float>: the eight f16 at byte o of wp."""
    h = _load_vec(builder, wp, o, ir.VectorType(ir.IntType(16), 8))
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _V8F)


def _packed_steps(builder, wp, o, c, xs_at):
    """Sub-blocks 2c and 2c + 1 of a packed super-block at byte o: ([<16 x i16>] per x, for each
    of the two) the eight steps' pmaddubsw sums, x's four bytes of step s of sub-block b at
    xs_at(b, s) for each x (a list of functions, one per token)."""
    m4 = ir.Constant(_i8(32), [15] * 32)
    z16 = ir.Constant(_i16(16), [0] * 16)
    acc = [[z16, z16] for _ in xs_at]
    for s in range(8):
        q = _load_vec(builder, wp, builder.add(o, const(256 * c + 32 * s)), _i8(32))
        lo = builder.and_(q, m4)
        hi = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(q, _i16(16)), ir.Constant(_i16(16), [4] * 16)),
                                          _i8(32)), m4)
        for t, at in enumerate(xs_at):
            for h, cv in ((0, lo), (1, hi)):
                xv = builder.bitcast(_splat(builder, at(2 * c + h, s), _i32(8)), _i8(32))
                acc[t][h] = builder.add(acc[t][h], _maddubs(builder, cv, xv))
    return acc


def _packed_scale(builder, wp, o, b):
    """<16 x i16>: the eight rows' scales of sub-block b as (sc, sc) pairs, lane pair r = row r."""
    sc = builder.zext(_load_vec(builder, wp, builder.add(o, const(_P_SC + 8 * b)), _i8(8)), _i32(8))
    return builder.bitcast(builder.or_(sc, builder.shl(sc, ir.Constant(_i32(8), [16] * 8))), _i16(16))


def _packed_mins(builder, wp, o, c):
    """<16 x i16>: the rows' mins of sub-blocks 2c, 2c + 1 as pairs (lane pair r = row r)."""
    return builder.zext(_load_vec(builder, wp, builder.add(o, const(_P_MN + 16 * c)), _i8(16)), _i16(16))


def _x4(builder, xp, xo):
    return lambda b, s: _load_vec(builder, xp, builder.add(xo, const(32 * b + 4 * s)), _I32)


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
            wp, xp, dp, sp, op = _pointers(context, builder, signature, args, (0, 2, 3, 4, 7))
            zero = ir.Constant(_V8F, [0.0] * 8)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(n_tok)]
            accms = [cgutils.alloca_once_value(builder, zero) for _ in range(n_tok)]
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                o = builder.add(w_off_, builder.mul(j, const(Q4_K8_SB)))
                if PACKED_AHEAD:
                    _prefetch(builder, wp, builder.add(o, const(PACKED_AHEAD * Q4_K8_SB)), Q4_K8_SB - 64)
                its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(n_tok)]
                pairs = []
                for i in its:  # x's sums per 32, as il8_q4_k takes them
                    s16 = _load_vec(builder, sp, builder.mul(i, const(16)), _i32(16))
                    s32 = builder.add(builder.shuffle_vector(s16, s16, ir.Constant(_i32(8), list(range(0, 16, 2)))),
                                      builder.shuffle_vector(s16, s16, ir.Constant(_i32(8), list(range(1, 16, 2)))))
                    pairs.append(builder.bitcast(builder.trunc(s32, _i16(8)), _i32(4)))
                isum, msum = [None] * n_tok, [None] * n_tok
                for c in range(4):
                    steps = _packed_steps(builder, wp, o, c, [_x4(builder, xp, builder.mul(i, const(256))) for i in its])
                    scales = (_packed_scale(builder, wp, o, 2 * c), _packed_scale(builder, wp, o, 2 * c + 1))
                    mins = _packed_mins(builder, wp, o, c)
                    for t in range(n_tok):
                        for a16, sc in zip(steps[t], scales):
                            p = _madd16(builder, a16, sc)
                            isum[t] = p if isum[t] is None else builder.add(isum[t], p)
                        xpair = _splat(builder, builder.extract_element(pairs[t], ir.Constant(_I32, c)), _i32(8))
                        p = _madd16(builder, mins, builder.bitcast(xpair, _i16(16)))
                        msum[t] = p if msum[t] is None else builder.add(msum[t], p)
                dw = _halves_lanes(builder, wp, builder.add(o, const(_P_D)))
                dmw = _halves_lanes(builder, wp, builder.add(o, const(_P_DMIN)))
                for t, i in enumerate(its):
                    dx = _splat(builder, builder.load(builder.gep(dp, [i])), _V8F)
                    d, dmin = builder.fmul(dw, dx), builder.fmul(dmw, dx)
                    builder.store(_fma(builder, builder.sitofp(isum[t], _V8F), d, builder.load(accs[t])), accs[t])
                    builder.store(_fma(builder, builder.sitofp(msum[t], _V8F), dmin, builder.load(accms[t])), accms[t])
            for t in range(n_tok):
                res = builder.fsub(builder.load(accs[t]), builder.load(accms[t]))
                _store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), res)
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
    llama.cpp's four-token Q4_K kernel (kquants._row_q4_k with per_pair: an fma per pair of
    sub-blocks, bit for bit): token t's super-blocks at b_off + t nb, its results at out_off +
    t out_stride. xs here: int16 sums of x per sub-block of 32 (kquants.sums32), block i's eight
    at 8 i; a pair of sub-blocks' min term is one pmaddwd for the eight rows."""
    u64 = types.uint64
    sig = types.void(w, u64, xq, xd, xs, u64, u64, out, u64, u64)

    def codegen(context, builder, signature, args):
        w_off_, b_off_, nb_, out_off_, out_stride_ = args[1], args[5], args[6], args[8], args[9]
        wp, xp, dp, gp, op = _pointers(context, builder, signature, args, (0, 2, 3, 4, 7))
        zero = ir.Constant(_V8F, [0.0] * 8)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        accms = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            o = builder.add(w_off_, builder.mul(j, const(Q4_K8_SB)))
            dw = _halves_lanes(builder, wp, builder.add(o, const(_P_D)))
            dmw = _halves_lanes(builder, wp, builder.add(o, const(_P_DMIN)))
            its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(4)]
            dxs = [_splat(builder, builder.load(builder.gep(dp, [i])), _V8F) for i in its]
            dd = [builder.fmul(dw, dx) for dx in dxs]
            dm = [builder.fmul(dmw, dx) for dx in dxs]
            ats = [_x4(builder, xp, builder.mul(i, const(256))) for i in its]
            for c in range(4):
                acc16 = _packed_steps(builder, wp, o, c, ats)
                sc_lo, sc_hi = _packed_scale(builder, wp, o, 2 * c), _packed_scale(builder, wp, o, 2 * c + 1)
                mc = _packed_mins(builder, wp, o, c)
                for t, i in enumerate(its):
                    part = builder.add(_madd16(builder, acc16[t][0], sc_lo), _madd16(builder, acc16[t][1], sc_hi))
                    x2 = _load_vec(builder, gp, builder.add(builder.mul(i, const(8)), const(2 * c)), _I32)
                    msum = _madd16(builder, mc, builder.bitcast(_splat(builder, x2, _i32(8)), _i16(16)))
                    builder.store(_fma(builder, builder.sitofp(part, _V8F), dd[t], builder.load(accs[t])), accs[t])
                    builder.store(_fma(builder, builder.sitofp(msum, _V8F), dm[t], builder.load(accms[t])), accms[t])
        for t in range(4):
            res = builder.fsub(builder.load(accs[t]), builder.load(accms[t]))
            _store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), res)
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
        cp, dwp, xp, dp, sp, op = _pointers(context, builder, signature, args, (0, 1, 3, 4, 5, 8))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(4)]
        ones = ir.Constant(_i16(16), [1] * 16)
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            g = builder.add(g_off_, j)
            dw = _load_vec(builder, dwp, builder.mul(g, const(8)), _V8F)
            its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(4)]
            # VNNI: vpdpbusd sums each step's four products straight into the 32-bit lanes
            acc = [ir.Constant(_i32(8) if VNNI else _i16(16), [0] * (8 if VNNI else 16))] * 4
            for s in range(8):
                w = _load_vec(builder, cp, builder.add(builder.mul(g, const(IL_Q4_0)), const(32 * s)), _i8(32))
                for t, i in enumerate(its):
                    x4 = _load_vec(builder, xp, builder.add(builder.mul(i, const(32)), const(4 * s)), ir.IntType(32))
                    xv = builder.bitcast(_splat(builder, x4, _i32(8)), _i8(32))
                    acc[t] = (_dpbusd(builder, acc[t], w, xv) if VNNI else
                              builder.add(acc[t], _maddubs(builder, w, xv)))
            for t, i in enumerate(its):
                xs8 = builder.mul(builder.load(builder.gep(sp, [i])), ir.Constant(_I32, 8))
                lanes = acc[t] if VNNI else _madd16(builder, acc[t], ones)
                isum = builder.sub(lanes, _splat(builder, xs8, _i32(8)))
                d = builder.fmul(dw, _splat(builder, builder.load(builder.gep(dp, [i])), _V8F))
                builder.store(_fma(builder, builder.sitofp(isum, _V8F), d, builder.load(accs[t])), accs[t])
        for t in range(4):
            _store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), builder.load(accs[t]))
        return context.get_dummy_value()

    return sig, codegen
