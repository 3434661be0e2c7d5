"""Vector math in ggml's order: expf as ggml_v_expf computes it (expf_ggml; eight lanes in
exp_shifted), and SwiGLU's silu(gate) * up eight lanes at a time (silu_mul_v8).
"""
from __future__ import annotations

import numpy as np

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.common import F32, U, f32_as_u32, njit, u32_as_f32
from edgellm.kernels.cpu.ir.builder import fma32, llvm_fn, splat, vec_ptr

_EXP_R = F32(float.fromhex("0x1.8p23"))


_EXP_LOG2E = F32(float.fromhex("0x1.715476p+0"))


_EXP_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))


_EXP_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))


_EXP_C = tuple(F32(float.fromhex(h)) for h in
               ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1"))


@njit(inline="always")
def expf_ggml(x):
    """exp(x) as ggml's vectorized CPU code computes it on x86 (a polynomial after range reduction,
    within 1.5 ulp of exp; its softmax and SiLU use it), one lane at a time. -inf -> 0."""
    z = fma32(x, _EXP_LOG2E, _EXP_R)
    n = z - _EXP_R
    b = fma32(-n, _EXP_LN2_LO, fma32(-n, _EXP_LN2_HI, x))
    e = (U(f32_as_u32(z)) << U(23)) & U(0xFFFFFFFF)
    k = u32_as_f32(np.uint32((e + U(0x3F800000)) & U(0xFFFFFFFF)))
    u = b * b
    j = fma32(fma32(fma32(_EXP_C[0], b, _EXP_C[1]), u, fma32(_EXP_C[2], b, _EXP_C[3])), u, _EXP_C[4] * b)
    # both of ggml's branches computed and one selected: no jumps, so loops of it vectorize
    g = U(0x82000000) if n <= F32(0.0) else U(0)
    s1 = u32_as_f32(np.uint32((g + U(0x7F000000)) & U(0xFFFFFFFF)))
    s2 = u32_as_f32(np.uint32((e - g) & U(0xFFFFFFFF)))
    big = s1 * s1 if abs(n) > F32(192.0) else fma32(s2, j, s2) * s1
    return big if abs(n) > F32(126.0) else fma32(j, k, k)


# --- ggml's exp eight lanes at a time -----------------------------------------------------------
# expf_ggml above, written as <8 x float> IR: the same operations lane by lane (so the same bits),
# which LLVM does not vectorize from the scalar form (its 32-bit integer steps become 64-bit ones
# in Numba).
def _expf_ggml_v8(builder, x):
    v = ir.VectorType(ir.FloatType(), 8)
    vi = ir.VectorType(ir.IntType(32), 8)

    def c(value):
        return ir.Constant(v, [float(value)] * 8)

    def ci(value):
        return ir.Constant(vi, [value] * 8)

    fma = llvm_fn(builder, "llvm.fma.v8f32", v, [v, v, v])
    fabs = llvm_fn(builder, "llvm.fabs.v8f32", v, [v])
    z = builder.call(fma, [x, c(_EXP_LOG2E), c(_EXP_R)])
    n = builder.fsub(z, c(_EXP_R))
    neg_n = builder.fneg(n)
    b = builder.call(fma, [neg_n, c(_EXP_LN2_LO), builder.call(fma, [neg_n, c(_EXP_LN2_HI), x])])
    e = builder.shl(builder.bitcast(z, vi), ci(23))
    k = builder.bitcast(builder.add(e, ci(0x3F800000)), v)
    u = builder.fmul(b, b)
    j = builder.call(fma, [builder.call(fma, [builder.call(fma, [c(_EXP_C[0]), b, c(_EXP_C[1])]), u,
                                              builder.call(fma, [c(_EXP_C[2]), b, c(_EXP_C[3])])]),
                           u, builder.fmul(c(_EXP_C[4]), b)])
    g = builder.select(builder.fcmp_ordered("<=", n, c(0.0)), ci(0x82000000 - (1 << 32)), ci(0))
    s1 = builder.bitcast(builder.add(g, ci(0x7F000000)), v)
    s2 = builder.bitcast(builder.sub(e, g), v)
    an = builder.call(fabs, [n])
    big = builder.select(builder.fcmp_ordered(">", an, c(192.0)), builder.fmul(s1, s1),
                         builder.fmul(builder.call(fma, [s2, j, s2]), s1))
    return builder.select(builder.fcmp_ordered(">", an, c(126.0)), big, builder.call(fma, [j, k, k]))


@intrinsic
def exp_shifted(typingctx, s, n, m):
    """s[j] = expf_ggml(s[j] - m) for j < n (a multiple of 8), 0 where s[j] is -inf (a masked
    score), eight lanes at a time; s float32."""
    sig = types.void(s, types.uint64, types.float32)

    def codegen(context, builder, signature, args):
        s_, n_, m_ = args
        sp = context.make_array(signature.args[0])(context, builder, s_).data
        v = ir.VectorType(ir.FloatType(), 8)
        mv = splat(builder, m_, v)
        inf = ir.Constant(v, [float("-inf")] * 8)
        with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(ir.IntType(64), 8))) as loop:
            ptr = vec_ptr(builder, sp, builder.mul(loop.index, ir.Constant(ir.IntType(64), 8)))
            x = builder.load(ptr, align=4)
            e = _expf_ggml_v8(builder, builder.fsub(x, mv))
            builder.store(builder.select(builder.fcmp_ordered("==", x, inf), ir.Constant(v, [0.0] * 8), e), ptr,
                          align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def silu_mul_v8(typingctx, gate, up, out, off, n):
    """out[off + i] = gate / (1 + expf_ggml(-gate)) * up at off + i, i < n (a multiple of 8), eight
    lanes at a time; float32 arrays (flat)."""
    sig = types.void(gate, up, out, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        g_, u_, o_, off_, n_ = args
        gp, up_, op = (context.make_array(t)(context, builder, a).data for t, a in zip(signature.args[:3], args[:3]))
        v = ir.VectorType(ir.FloatType(), 8)
        one = ir.Constant(v, [1.0] * 8)
        with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(ir.IntType(64), 8))) as loop:
            o = builder.add(off_, builder.mul(loop.index, ir.Constant(ir.IntType(64), 8)))
            g = builder.load(vec_ptr(builder, gp, o), align=4)
            e = _expf_ggml_v8(builder, builder.fneg(g))
            r = builder.fmul(builder.fdiv(g, builder.fadd(one, e)), builder.load(vec_ptr(builder, up_, o), align=4))
            builder.store(r, vec_ptr(builder, op, o), align=4)
        return context.get_dummy_value()

    return sig, codegen
