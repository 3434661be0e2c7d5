"""The 4-bit non-linear codes as LLVM vector IR, and IQ4_XS's one-row dot product with a Q8_K row
in ggml's x86 order (ggml_vec_dot_iq4_xs_q8_K), one intrinsic per row:

    rowdot_iq4_xs(w, w_off, xq, x_off, xd, b_off, nb) -> float32

per super-block 8 integer lanes sum_s (ls_s - 32) * quad sums (exact), acc = fma(d_w * d_x,
f32(lanes), acc); hsum_float_8 at the end.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import AVX2
from edgellm.kernels.cpu.ir.builder import (V8F, abs_sign, array_ptr, block_loop, const, fma, hsum8, i8, i16,
                                            i32, llvm_fn, load_half, load_vec, madd16, maddubs16, prefetch_row,
                                            splat)
from edgellm.quants import KVALUES_IQ4NL

IQ4_XS_BYTES = 2 + 2 + 4 + 128  # d | scales_h (u16) | scales_l[4] | qs[128]


def iq4_values(builder, raw):
    """<16 x i8> code bytes -> <32 x i8>: the values of the low nibbles, then of the high."""
    nib = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(i8(16), [4] * 16)),
                                 ir.Constant(i32(32), list(range(32))))
    nib = builder.and_(nib, ir.Constant(i8(32), [15] * 32))
    table = ir.Constant(i8(32), [int(v) for v in KVALUES_IQ4NL] * 2)
    if AVX2:
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.pshuf.b", i8(32), [i8(32), i8(32)]), [table, nib])
    vals = ir.Constant(i8(32), ir.Undefined)
    for i in range(32):
        idx = builder.extract_element(nib, ir.Constant(ir.IntType(32), i))
        vals = builder.insert_element(vals, builder.extract_element(table, idx), ir.Constant(ir.IntType(32), i))
    return vals


def _xs_scales(builder, wp, o):
    """The eight sub-blocks' ls - 32 of the super-block at byte o, each splat over <16 x i16>."""
    i16_t = ir.IntType(16)
    sh = builder.load(builder.bitcast(builder.gep(wp, [builder.add(o, const(2))]), i16_t.as_pointer()), align=1)
    out = []
    for s in range(8):
        lo = builder.load(builder.gep(wp, [builder.add(o, const(4 + s // 2))]))
        lo = builder.and_(builder.lshr(builder.zext(lo, i16_t), ir.Constant(i16_t, 4 * (s & 1))),
                          ir.Constant(i16_t, 15))
        hi = builder.shl(builder.and_(builder.lshr(sh, ir.Constant(i16_t, 2 * s)), ir.Constant(i16_t, 3)),
                         ir.Constant(i16_t, 4))
        out.append(splat(builder, builder.sub(builder.or_(lo, hi), ir.Constant(i16_t, 32)), i16(16)))
    return out


@intrinsic
def rowdot_iq4_xs(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: the IQ4_XS row at w[w_off:] times token x (Q8_K: values xq[x_off:], scales
    xd[b_off:]) over nb super-blocks, in ggml_vec_dot_iq4_xs_q8_K's order."""
    u64 = types.uint64
    sig = types.float32(w, u64, xq, u64, xd, u64, u64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = array_ptr(context, builder, signature.args[0], w_)
        xp = array_ptr(context, builder, signature.args[2], xq_)
        dp = array_ptr(context, builder, signature.args[4], xd_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(IQ4_XS_BYTES)))
            prefetch_row(builder, wp, o, IQ4_XS_BYTES)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            sumi = ir.Constant(i32(8), [0] * 8)
            for sb, sc in enumerate(_xs_scales(builder, wp, o)):
                vals = iq4_values(builder, load_vec(builder, wp, builder.add(o, const(8 + 16 * sb)), i8(16)))
                u, sx = abs_sign(builder, vals, load_vec(builder, xp, builder.add(xo, const(32 * sb)), i8(32)))
                sumi = builder.add(sumi, madd16(builder, maddubs16(builder, u, sx), sc))
            d = builder.fmul(load_half(builder, wp, o), builder.load(builder.gep(dp, [builder.add(b_off_, i)])))
            return fma(builder, splat(builder, d, V8F), builder.sitofp(sumi, V8F), acc), s

        acc, _ = block_loop(context, builder, nb_, body)
        return hsum8(builder, acc)

    return sig, codegen

