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
    rows8x4_q4_0(w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off, out_stride)  # four tokens
    rows8x4_q4_k(w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off, out_stride)  # (gemm order)

w: uint8 weights, row r (0..7) at byte w_off + r * rb; activations as in the one-row kernels
(Q8_0 "q8_32" parts with xs the block sums, or Q8_K parts with xs the 16-value sums), block i at
b_off + i; out[out_off + r] = row r's dot product.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.common import AVX2, _fn, _i8, _i16, _i32, _splat
from edgellm.kernels.cpu.rowdot import _V8F, _fma, _k_scales, _load_vec, _madd16, _ptr, const
from edgellm.kernels.cpu.rowdot import _maddubs16 as _maddubs

_I32 = ir.IntType(32)


def _hadd(builder, a, b):
    """phaddd: [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] (per 128-bit half)."""
    if AVX2:
        return builder.call(_fn(builder, "llvm.x86.avx2.phadd.d", _i32(8), [_i32(8), _i32(8)]), [a, b])
    ev, od = [0, 2, 8, 10, 4, 6, 12, 14], [1, 3, 9, 11, 5, 7, 13, 15]
    return builder.add(builder.shuffle_vector(a, b, ir.Constant(_i32(8), ev)),
                       builder.shuffle_vector(a, b, ir.Constant(_i32(8), od)))


def _reduce8(builder, vs):
    """<8 x i32>: lane r = the sum of the lanes of vs[r] (eight <8 x i32>; integers, exact)."""
    h0 = _hadd(builder, _hadd(builder, vs[0], vs[1]), _hadd(builder, vs[2], vs[3]))
    h1 = _hadd(builder, _hadd(builder, vs[4], vs[5]), _hadd(builder, vs[6], vs[7]))
    lo = builder.shuffle_vector(h0, h1, ir.Constant(_i32(8), [0, 1, 2, 3, 8, 9, 10, 11]))
    hi = builder.shuffle_vector(h0, h1, ir.Constant(_i32(8), [4, 5, 6, 7, 12, 13, 14, 15]))
    return builder.add(lo, hi)


def _halves8(builder, wp, offs):
    """<8 x float>: the f16 values at byte offsets offs (eight i64) of wp."""
    v = ir.Constant(ir.VectorType(ir.IntType(16), 8), ir.Undefined)
    for r, o in enumerate(offs):
        h = builder.load(builder.bitcast(builder.gep(wp, [o]), ir.IntType(16).as_pointer()), align=1)
        v = builder.insert_element(v, h, ir.Constant(_I32, r))
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), _V8F)


def _prefetch(builder, wp, o, n):
    """Prefetch bytes [o, o + n + 64) of wp: the next group of rows, read linearly while this group
    is summed (eight interleaved short row streams defeat the hardware's stream detection; one
    linear stream ahead of them does not)."""
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32])
    for k in range(0, n + 1, 64):
        builder.call(fn, [builder.gep(wp, [builder.add(o, const(k))]), ir.Constant(_I32, 0),
                          ir.Constant(_I32, 2), ir.Constant(_I32, 1)])


def _store8(builder, op, off, v):
    builder.store(v, builder.bitcast(builder.gep(op, [off]), _V8F.as_pointer()), align=4)


def _pointers(context, builder, signature, args, which):
    """The data pointers of the array arguments at positions `which`."""
    return [_ptr(context, builder, signature.args[k], args[k]) for k in which]


def _group(builder, w_off, rb):
    """(the eight rows' byte offsets, the offset of the group after the next: what `_ahead` reads)."""
    return ([builder.add(w_off, builder.mul(const(r), rb)) for r in range(8)],
            builder.add(w_off, builder.mul(const(16), rb)))


def _ahead(builder, wp, ahead, j, block):
    """At block j of a group: prefetch the j-th stretch of eight blocks' bytes from `ahead` on (the
    group after the next, whose eight rows lie one after another), so the loop's pace reads that
    group linearly by the time it ends."""
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
                    isum, msum = _q4_k_sums(builder, wp, offs, xp, sp, i)
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
    quads = [_madd16(builder, _maddubs(builder, q, x), ir.Constant(_i16(16), [1] * 16)) for q in codes]
    xs8 = builder.mul(builder.load(builder.gep(sp, [i])), ir.Constant(_I32, 8))
    return builder.sub(_reduce8(builder, quads), _splat(builder, xs8, _i32(8)))


@intrinsic
def rows8x4_q4_0(typingctx, w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off, out_stride):
    """rows8_q4_0 for four tokens (token t's blocks at b_off + t nb, its results at out_off +
    t out_stride): each block's codes are unpacked once for the four; every (row, token) result
    is the one-token kernel's, bit for bit. No prefetch (the prompt products read rows in cache)."""
    sig = types.void(w, types.uint64, types.uint64, xq, xd, xs, types.uint64, types.uint64, out, types.uint64,
                     types.uint64)

    def codegen(context, builder, signature, args):
        w_off_, rb_, b_off_, nb_, out_off_, out_stride_ = args[1], args[2], args[6], args[7], args[9], args[10]
        wp, xp, dp, sp, op = _pointers(context, builder, signature, args, (0, 3, 4, 5, 8))
        rows, _ = _group(builder, w_off_, rb_)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(4)]
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            offs = [builder.add(r, builder.mul(j, const(18))) for r in rows]
            codes = _q4_0_codes(builder, wp, offs)
            dw = _halves8(builder, wp, offs)
            for t in range(4):
                i = builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j)
                isum = _q4_0_sums(builder, codes, xp, sp, i)
                d = builder.fmul(dw, _splat(builder, builder.load(builder.gep(dp, [i])), _V8F))
                builder.store(_fma(builder, builder.sitofp(isum, _V8F), d, builder.load(accs[t])), accs[t])
        for t in range(4):
            _store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), builder.load(accs[t]))
        return context.get_dummy_value()

    return sig, codegen


def _q4_k_sums(builder, wp, offs, xp, sp, i):
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
        tot = None
        for c in range(4):
            q = _load_vec(builder, wp, builder.add(o, const(16 + 32 * c)), _i8(32))
            for half, qv in enumerate((builder.and_(q, mask), builder.and_(builder.lshr(q, ir.Constant(_i8(32), [4] * 32)), mask))):
                b = 2 * c + half
                sc = builder.shuffle_vector(sm, sm, ir.Constant(_i32(16), [b] * 16))
                p = _madd16(builder, _maddubs(builder, qv, xs[b]), sc)
                tot = p if tot is None else builder.add(tot, p)
        isums.append(tot)
    return _reduce8(builder, isums), _reduce8(builder, msums)


rows8_q4_0 = _rows8("q4_0")
rows8_q4_k = _rows8("q4_k")


def _gather32(builder, wp, offs, k):
    """<8 x i32>: the little-endian word at byte offs[r] + k of each row (lane r)."""
    v = ir.Constant(_i32(8), ir.Undefined)
    for r, o in enumerate(offs):
        p = builder.bitcast(builder.gep(wp, [builder.add(o, const(k))]), _I32.as_pointer())
        v = builder.insert_element(v, builder.load(p, align=1), ir.Constant(_I32, r))
    return v


def _k_scales_lanes(builder, wp, offs):
    """([S_b], [M_b]) for b < 8: <8 x i32> with row r's 6-bit scale / min of sub-block b in lane r."""
    def c(v):
        return _splat(builder, ir.Constant(_I32, v), _i32(8))

    u0, u1, u2 = (_gather32(builder, wp, offs, 4 + 4 * k) for k in range(3))
    lo6, lo4, hi2 = c(0x3F3F3F3F), c(0x0F0F0F0F), c(0x03030303)
    sc03, mn03 = builder.and_(u0, lo6), builder.and_(u1, lo6)
    sc47 = builder.or_(builder.and_(u2, lo4), builder.shl(builder.and_(builder.lshr(u0, c(6)), hi2), c(4)))
    mn47 = builder.or_(builder.and_(builder.lshr(u2, c(4)), lo4),
                       builder.shl(builder.and_(builder.lshr(u1, c(6)), hi2), c(4)))

    def byte(v, k):
        return builder.and_(builder.lshr(v, c(8 * k)), c(255))

    return ([byte(sc03, b) for b in range(4)] + [byte(sc47, b) for b in range(4)],
            [byte(mn03, b) for b in range(4)] + [byte(mn47, b) for b in range(4)])


@intrinsic
def rows8x4_q4_k(typingctx, w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off, out_stride):
    """Eight Q4_K rows x four tokens in the order of llama.cpp's four-token Q4_K kernel
    (kquants._row_q4_k with per_pair: an fma per pair of sub-blocks): token t's super-blocks at
    b_off + t nb, its results at out_off + t out_stride. The rows' scales and mins are unpacked once
    as lanes (the mins' products need no horizontal sum), the codes once per pair for the four
    tokens; every (row, token) result is the one-row kernel's, bit for bit."""
    sig = types.void(w, types.uint64, types.uint64, xq, xd, xs, types.uint64, types.uint64, out, types.uint64,
                     types.uint64)

    def codegen(context, builder, signature, args):
        w_off_, rb_, b_off_, nb_, out_off_, out_stride_ = args[1], args[2], args[6], args[7], args[9], args[10]
        wp, xp, dp, sp, op = _pointers(context, builder, signature, args, (0, 3, 4, 5, 8))
        rows, _ = _group(builder, w_off_, rb_)
        zero = ir.Constant(_V8F, [0.0] * 8)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        accms = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        mask = ir.Constant(_i8(32), [15] * 32)
        four = ir.Constant(_i8(32), [4] * 32)
        with cgutils.for_range(builder, nb_) as loop:
            j = loop.index
            offs = [builder.add(r, builder.mul(j, const(144))) for r in rows]
            S, M = _k_scales_lanes(builder, wp, offs)
            dw = _halves8(builder, wp, offs)
            dmw = _halves8(builder, wp, [builder.add(o, const(2)) for o in offs])
            its = [builder.add(builder.add(b_off_, builder.mul(const(t), nb_)), j) for t in range(4)]
            dxs = [_splat(builder, builder.load(builder.gep(dp, [i])), _V8F) for i in its]
            dd = [builder.fmul(dw, dx) for dx in dxs]
            dm = [builder.fmul(dmw, dx) for dx in dxs]
            for c in range(4):
                codes, spl = [], []
                for r, o in enumerate(offs):
                    q = _load_vec(builder, wp, builder.add(o, const(16 + 32 * c)), _i8(32))
                    codes.append((builder.and_(q, mask), builder.and_(builder.lshr(q, four), mask)))
                    spl.append(tuple(_splat(builder, builder.trunc(builder.extract_element(S[2 * c + h], ir.Constant(_I32, r)),
                                                                     ir.IntType(16)), _i16(16)) for h in range(2)))
                for t, i in enumerate(its):
                    xo = builder.add(builder.mul(i, const(256)), const(64 * c))
                    x_lo = _load_vec(builder, xp, xo, _i8(32))
                    x_hi = _load_vec(builder, xp, builder.add(xo, const(32)), _i8(32))
                    parts = [builder.add(_madd16(builder, _maddubs(builder, lo, x_lo), s_lo),
                                         _madd16(builder, _maddubs(builder, hi, x_hi), s_hi))
                             for (lo, hi), (s_lo, s_hi) in zip(codes, spl)]
                    isum = _reduce8(builder, parts)
                    g = builder.add(builder.mul(i, const(16)), const(4 * c))
                    xsv = [builder.load(builder.gep(sp, [builder.add(g, const(k))])) for k in range(4)]
                    msum = builder.add(
                        builder.mul(M[2 * c], _splat(builder, builder.add(xsv[0], xsv[1]), _i32(8))),
                        builder.mul(M[2 * c + 1], _splat(builder, builder.add(xsv[2], xsv[3]), _i32(8))))
                    builder.store(_fma(builder, builder.sitofp(isum, _V8F), dd[t], builder.load(accs[t])), accs[t])
                    builder.store(_fma(builder, builder.sitofp(msum, _V8F), dm[t], builder.load(accms[t])), accms[t])
        for t in range(4):
            res = builder.fsub(builder.load(accs[t]), builder.load(accms[t]))
            _store8(builder, op, builder.add(out_off_, builder.mul(const(t), out_stride_)), res)
        return context.get_dummy_value()

    return sig, codegen


# --- eight rows of Q8_0 -----------------------------------------------------------------------
# The one-row Q8_0 kernel (rowdot.rowdot_q8_0, ggml's vec_dot order) carries one chain of dependent
# fmas through a row's blocks (acc = fma(d_w d_x, float(lanes), acc)) and is bound by it, not by the
# memory: the 262144 x 640 Q8_0 head of Gemma-3 ran at the same 11.6 GB/s on one thread from DRAM as
# a 0.7 MB matrix from L2. Eight rows at once run eight independent chains, each row's in its own
# order, so every result is the one-row kernel's bit for bit, and each x block is loaded once for
# the eight. (The same for Q4_1 and Q5_0 was measured and not kept: no gain at 2 threads.)
_Q8_0_BYTES = 34


@intrinsic
def rows8_q8_0(typingctx, w, w_off, rb, xq, x_off, xd, b_off, nb, out, out_off):
    """out[out_off + r] for the Q8_0 rows r = 0..7 at w_off + r rb: what rowdot_q8_0 gives each (x
    in Q8_0 form: xq from x_off, block i's scale xd[b_off + i])."""
    sig = types.void(w, types.uint64, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64, out,
                     types.uint64)

    def codegen(context, builder, signature, args):
        from edgellm.kernels.cpu.rowdot import _abs_sign, _hsum8, _load_half, _quad_sums

        w_off_, rb_, x_off_, b_off_, nb_, out_off_ = args[1], args[2], args[4], args[6], args[7], args[9]
        wp, xp, dp, op = _pointers(context, builder, signature, args, (0, 3, 5, 8))
        block = _Q8_0_BYTES
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
                ax, sy = _abs_sign(builder, _load_vec(builder, wp, builder.add(o, const(2)), _i8(32)), qy)
                xy = builder.sitofp(_quad_sums(builder, ax, sy), _V8F)
                d = _splat(builder, builder.fmul(d0, d1), _V8F)
                builder.store(_fma(builder, d, xy, builder.load(accs[r])), accs[r])
        for r in range(8):
            builder.store(_hsum8(builder, builder.load(accs[r])), builder.gep(op, [builder.add(out_off_, const(r))]))
        return context.get_dummy_value()

    return sig, codegen
