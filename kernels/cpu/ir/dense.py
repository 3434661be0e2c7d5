"""Dot products of float16 / bfloat16 weight rows, in ggml's vec_dot_f16 / vec_dot_bf16 order
(dot_f16 / dot_bf16: n_acc 8-lane accumulators, fma in element order, then their reduction).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.ir.builder import I64_T, V8F, array_ptr, fma, hsum8, i32, load_vec

def _dense_dot(bf16: bool):
    """The f16 (bf16) dot product intrinsic; see dot_f16."""

    def dot(typingctx, k, k_off, q, q_off, n, n_acc):
        if not isinstance(n_acc, types.IntegerLiteral):
            return None
        groups = n_acc.literal_value
        half = k.dtype in (types.uint16, types.uint8)  # 16-bit float bits; otherwise float32
        sig = types.float32(k, types.uint64, q, types.uint64, types.uint64, n_acc)

        def codegen(context, builder, signature, args):
            k_, k_off_, q_, q_off_, n_, _ = args
            kp = array_ptr(context, builder, signature.args[0], k_)
            if half:
                kp = builder.bitcast(kp, ir.IntType(16).as_pointer())
            qp = array_ptr(context, builder, signature.args[2], q_)
            zero = ir.Constant(V8F, [0.0] * 8)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(groups)]
            steps = builder.udiv(n_, ir.Constant(I64_T, 8 * groups))
            with cgutils.for_range(builder, steps) as loop:
                o = builder.mul(loop.index, ir.Constant(I64_T, 8 * groups))
                for a in range(groups):
                    oa = builder.add(o, ir.Constant(I64_T, 8 * a))
                    if half:
                        kv = load_vec(builder, kp, builder.add(k_off_, oa), ir.VectorType(ir.IntType(16), 8))
                        if bf16:
                            wide = builder.shl(builder.zext(kv, i32(8)), ir.Constant(i32(8), [16] * 8))
                            kf = builder.bitcast(wide, V8F)
                        else:
                            kf = builder.fpext(builder.bitcast(kv, ir.VectorType(ir.HalfType(), 8)), V8F)
                    else:
                        kf = load_vec(builder, kp, builder.add(k_off_, oa), V8F)
                    qv = load_vec(builder, qp, builder.add(q_off_, oa), V8F)
                    builder.store(fma(builder, kf, qv, builder.load(accs[a])), accs[a])
            vals = [builder.load(a) for a in accs]
            if groups == 1:
                return hsum8(builder, vals[0])
            s = builder.fadd(builder.fadd(vals[0], vals[2]), builder.fadd(vals[1], vals[3]))
            if bf16:
                return hsum8(builder, s)

            def lane(i):
                return builder.extract_element(s, ir.Constant(ir.IntType(32), i))

            t = [builder.fadd(lane(i), lane(i + 4)) for i in range(4)]
            return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))

        return sig, codegen

    dot.__name__ = "dot_bf16" if bf16 else "dot_f16"
    return intrinsic(dot)


dot_f16 = _dense_dot(False)


dot_f16.__doc__ = """float32 sum_{i<n} float(k[k_off + i]) * q[q_off + i] for float16 k (as uint16 bits, or
the bytes of them: uint8, offsets still in elements) or float32 k and float32 q (already rounded
to k's type), n a multiple of 8 (of 32 when n_acc is 4), summed as ggml does: n_acc = 4
(vec_dot_f16: element i in lane i % 8 of accumulator (i / 8) % 4, the four added (0 + 2) +
(1 + 3), then lanes ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7))) or n_acc = 1 (tinyBLAS: one
accumulator, lanes ((4 + 0) + (6 + 2)) + ((5 + 1) + (7 + 3)))."""


dot_bf16 = _dense_dot(True)


dot_bf16.__doc__ = """dot_f16 for bfloat16 k: n_acc = 4 is vec_dot_bf16 (the four accumulators added as in
vec_dot_f16, then the lanes as hsum_float_8), n_acc = 1 tinyBLAS as for f16."""
