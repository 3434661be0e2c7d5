"""Eight weight rows times one activation row at once, for the decode products (Q4_0, Q4_K, Q8_0, Q5_0).

The one-row kernels reduce each block's integer products to one int32 with a full horizontal sum,
per row and per block: at 1B-8B widths that, not the memory, bounds decode. Here eight rows pass
over each activation block together: every row keeps its integer products in an <8 x i32> vector,
the eight vectors are summed into one (lane r = row r's exact block sum) by a tree of pairwise
adds, and the per-row float steps run as eight lanes of one vector op. The float order is the
one-row kernels' (llama.cpp's repacked 8-row x86 kernels): per block, per row,
acc = fma(float(isum), d_w * d_x, acc) in block order; integer sums are exact in any order. So each
output is the one-row kernel's, bit for bit, and eight row streams are in flight.

    rows8_q4_0 / rows8_q4_k(w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off)
    rows8_q8_0 / rows8_q5_0(w, w_off, rb, xq, x_off, xd, b_off, nb, out, out_off)

w: uint8 weights, row r (0..7) at byte w_off + r * rb; activations as in the one-row kernels
(Q8_0 "q8_32" parts with xs the block sums, or Q8_K parts with xs the 16-value sums), block i at
b_off + i; out[out_off + r] = row r's dot product.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import REGS32
from edgellm.kernels.cpu.ir.builder import (I32_T, V8F, abs_sign, array_ptr, const, fma, hsum8, i16, i32, i8, llvm_fn,
                                            load_half, load_vec, madd16, maddubs16, nibbles, prefetch, quad_sums,
                                            reduce8, splat)
from edgellm.kernels.cpu.ir.legacy import bits_spread
from edgellm.kernels.cpu.ir.kquants import k_scales

def halves8(builder, wp, offs):
    """<8 x float>: the f16 values at byte offsets offs (eight i64) of wp."""
    v = ir.Constant(ir.VectorType(ir.IntType(16), 8), ir.Undefined)
    for r, o in enumerate(offs):
        h = builder.load(builder.bitcast(builder.gep(wp, [o]), ir.IntType(16).as_pointer()), align=1)
        v = builder.insert_element(v, h, ir.Constant(I32_T, r))
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), 8)), V8F)


def store8(builder, op, off, v):
    builder.store(v, builder.bitcast(builder.gep(op, [off]), V8F.as_pointer()), align=4)


def row_pointers(context, builder, signature, args, which):
    """The data pointers of the array arguments at positions `which`."""
    return [array_ptr(context, builder, signature.args[k], args[k]) for k in which]


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
        prefetch(builder, wp, builder.add(ahead, builder.mul(j, const(8 * block))), 8 * block)


def _rows8(kind):
    block = {"q4_0": 18, "q4_k": 144}[kind]

    @intrinsic
    def rows8(typingctx, w, w_off, rb, xq, xd, xs, b_off, nb, out, out_off):
        sig = types.void(w, types.uint64, types.uint64, xq, xd, xs, types.uint64, types.uint64, out, types.uint64)

        def codegen(context, builder, signature, args):
            w_off_, rb_, b_off_, nb_, out_off_ = args[1], args[2], args[6], args[7], args[9]
            wp, xp, dp, sp, op = row_pointers(context, builder, signature, args, (0, 3, 4, 5, 8))
            rows, ahead = _group(builder, w_off_, rb_)
            zero = ir.Constant(V8F, [0.0] * 8)
            acc = cgutils.alloca_once_value(builder, zero)
            acc_m = cgutils.alloca_once_value(builder, zero)
            masks = _splat_masks(builder, nb_) if kind == "q4_k" and REGS32 else None
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                i = builder.add(b_off_, j)
                _ahead(builder, wp, ahead, j, block)
                offs = [builder.add(r, builder.mul(j, const(block))) for r in rows]
                dx = splat(builder, builder.load(builder.gep(dp, [i])), V8F)
                if kind == "q4_0":
                    isum = _q4_0_sums(builder, _q4_0_codes(builder, wp, offs), xp, sp, i)
                    d = builder.fmul(halves8(builder, wp, offs), dx)
                    builder.store(fma(builder, builder.sitofp(isum, V8F), d, builder.load(acc)), acc)
                else:
                    isum, msum = _q4_k_sums(builder, wp, offs, xp, sp, i, masks)
                    d = builder.fmul(halves8(builder, wp, offs), dx)
                    dmin = builder.fmul(halves8(builder, wp, [builder.add(o, const(2)) for o in offs]), dx)
                    builder.store(fma(builder, builder.sitofp(isum, V8F), d, builder.load(acc)), acc)
                    builder.store(fma(builder, builder.sitofp(msum, V8F), dmin, builder.load(acc_m)), acc_m)
            res = builder.load(acc)
            if kind == "q4_k":
                res = builder.fsub(res, builder.load(acc_m))
            store8(builder, op, out_off_, res)
            return context.get_dummy_value()

        return sig, codegen

    return rows8


def _q4_0_codes(builder, wp, offs):
    """The eight rows' blocks as <32 x i8> codes 0..15 (16 nibble bytes after the f16 scale)."""
    codes = []
    for o in offs:
        raw = load_vec(builder, wp, builder.add(o, const(2)), i8(16))
        both = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(i8(16), [4] * 16)),
                                      ir.Constant(i32(32), list(range(32))))
        codes.append(builder.and_(both, ir.Constant(i8(32), [15] * 32)))
    return codes


def _q4_0_sums(builder, codes, xp, sp, i):
    """<8 x i32>: row r's sum of (q - 8) x over block i of x."""
    x = load_vec(builder, xp, builder.mul(i, const(32)), i8(32))
    quads = [quad_sums(builder, q, x) for q in codes]
    xs8 = builder.mul(builder.load(builder.gep(sp, [i])), ir.Constant(I32_T, 8))
    return builder.sub(reduce8(builder, quads), splat(builder, xs8, i32(8)))


def _q4_k_sums(builder, wp, offs, xp, sp, i, masks):
    """(<8 x i32> isum, <8 x i32> msum) of the eight rows' super-block i: sum_b sc_b (q . x)_b and
    sum_b m_b (x sums of sub-block b)."""
    xo = builder.mul(i, const(256))
    xs = [load_vec(builder, xp, builder.add(xo, const(32 * k)), i8(32)) for k in range(8)]
    bsums = builder.trunc(load_vec(builder, sp, builder.mul(i, const(16)), i32(16)), i16(16))
    mask = ir.Constant(i8(32), [15] * 32)
    isums, msums = [], []
    for o in offs:
        sm = k_scales(builder, wp, o)
        mins = builder.shuffle_vector(sm, sm, ir.Constant(i32(16), [8 + k // 2 for k in range(16)]))
        msums.append(madd16(builder, mins, bsums))
        dup = builder.shuffle_vector(sm, sm, ir.Constant(i32(16), list(range(8)) * 2))  # scales in both halves
        tot = None
        for c in range(4):
            q = load_vec(builder, wp, builder.add(o, const(16 + 32 * c)), i8(32))
            for half, qv in enumerate((builder.and_(q, mask), builder.and_(builder.lshr(q, ir.Constant(i8(32), [4] * 32)), mask))):
                b = 2 * c + half
                sc = _word_splat(builder, dup, b, masks)
                p = madd16(builder, maddubs16(builder, qv, xs[b]), sc)
                tot = p if tot is None else builder.add(tot, p)
        isums.append(tot)
    return reduce8(builder, isums), reduce8(builder, msums)


def _splat_masks(builder, nb):
    """The pshufb masks of _word_splat, one per word, made once per call from a zero LLVM cannot see
    (nb >> 40: a row of 2^48 weights is far beyond any model); with constant masks LLVM turns the
    pshufb back into its own splat, a shift and a broadcast, twice the instructions."""
    zero = splat(builder, builder.trunc(builder.lshr(nb, const(40)), ir.IntType(8)), i8(32))
    return [builder.add(ir.Constant(i8(32), [2 * b, 2 * b + 1] * 16), zero) for b in range(8)]


def _word_splat(builder, dup, b, masks):
    """<16 x i16>: word b of dup (whose two 128-bit halves are alike) in every lane: one in-lane
    byte shuffle (pshufb) where the eight masks can stay in registers (32 of them); with AVX2's 16
    they would go to the stack, and LLVM's shift and broadcast is as fast."""
    if REGS32:
        fn = llvm_fn(builder, "llvm.x86.avx2.pshuf.b", i8(32), [i8(32), i8(32)])
        return builder.bitcast(builder.call(fn, [builder.bitcast(dup, i8(32)), masks[b]]), i16(16))
    return builder.shuffle_vector(dup, dup, ir.Constant(i32(16), [b] * 16))


rows8_q4_0 = _rows8("q4_0")


rows8_q4_k = _rows8("q4_k")


# --- eight rows of Q8_0 -----------------------------------------------------------------------
# The one-row Q8_0 kernel (ir.legacy.rowdot_q8_0, ggml's vec_dot order) carries one chain of dependent
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
            w_off_, rb_, x_off_, b_off_, nb_, out_off_ = args[1], args[2], args[4], args[6], args[7], args[9]
            wp, xp, dp, op = row_pointers(context, builder, signature, args, (0, 3, 5, 8))
            rows, ahead = _group(builder, w_off_, rb_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(8)]
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                _ahead(builder, wp, ahead, j, block)
                d1 = builder.load(builder.gep(dp, [builder.add(b_off_, j)]))
                qy = load_vec(builder, xp, builder.add(x_off_, builder.mul(j, const(32))), i8(32))
                for r in range(8):
                    o = builder.add(rows[r], builder.mul(j, const(block)))
                    d0 = load_half(builder, wp, o)
                    ax, sy = abs_sign(builder, codes(builder, wp, o), qy)
                    xy = builder.sitofp(quad_sums(builder, ax, sy), V8F)
                    d = splat(builder, builder.fmul(d0, d1), V8F)
                    builder.store(fma(builder, d, xy, builder.load(accs[r])), accs[r])
            for r in range(8):
                builder.store(hsum8(builder, builder.load(accs[r])),
                              builder.gep(op, [builder.add(out_off_, const(r))]))
            return context.get_dummy_value()

        return sig, codegen

    return rows8


def _q8_0_codes(builder, wp, o):
    return load_vec(builder, wp, builder.add(o, const(2)), i8(32))


def _q5_0_codes(builder, wp, o):
    """q - 16: the nibble with the high bits 0xF0 set where the 5th bit is clear."""
    qh = load_vec(builder, wp, builder.add(o, const(2)), I32_T)
    return builder.or_(nibbles(builder, wp, builder.add(o, const(6))),
                       builder.select(bits_spread(builder, qh), ir.Constant(i8(32), [0] * 32),
                                      ir.Constant(i8(32), [0xF0] * 32)))


# out[out_off + r] for the rows r = 0..7 at w_off + r rb: what rowdot_q8_0 / rowdot_q5_0 gives each
# (x in Q8_0 form: xq from x_off, block i's scale xd[b_off + i])
rows8_q8_0 = _rows8_q8_32(34, _q8_0_codes)


rows8_q5_0 = _rows8_q8_32(22, _q5_0_codes)
