"""Pieces every kernel family shares: bit casts, f16 -> f32, and the 8-bit activation format.

How the kernels are written, and why (measured on an AVX2 machine, Numba 0.68 / LLVM 20):
- Indices are unsigned (`U`): Numba wraps negative signed indices with a per-element select,
  which stops LLVM from seeing contiguous loads. Unsigned indices skip that.
- Integer locals are pinned to int32 (`I32`): Numba widens int arithmetic to int64 otherwise,
  which halves the SIMD lanes.
- The inner loops run to a trip count passed in at run time (`lanes`, always 16). With a
  literal 16, LLVM unrolls the inner loop fully and then vectorizes the loop over blocks with
  scalar inserts, about 3x slower. A run-time count keeps the inner loop the vectorized one.
- Matvec quantizes x once per product to 8-bit (blocks of 32, one float32 scale each, with
  int32 sums per 16) and takes integer dot products per block, like llama.cpp's Q8 activations:
  measured 1.3-2x faster than a float32 dot over the same blocks. The float accumulation over
  blocks is kept in order (no reassociation), so results are the same bits on every call.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

U = np.uint64
I32 = np.int32
F32 = np.float32

QK_X = 32  # activation block: one float32 scale per 32 int8 values
LANES = U(16)  # inner-loop trip count, passed at run time (see module docstring)

JIT = dict(cache=True, nogil=True, parallel=True)
# Every fast-math flag except reassociation: the block loop stays in order (deterministic) and is
# not vectorized across blocks; integer inner loops vectorize without it.
FAST_IN_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


@intrinsic
def u32_as_f32(typingctx, bits):
    """Reinterpret the 32 bits of a uint32 as a float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always")
def f16_to_f32(lo, hi):
    """IEEE half (two little-endian bytes) -> float32, exact for every input incl. inf/nan.

    Branch-free for normal numbers: scale signs are random in real weights, and a branch on the
    sign mispredicted half the time and made matvec 3x slower (measured).
    """
    h = U(lo) | (U(hi) << U(8))
    bits = (h & U(0x7FFF)) << U(13)  # exponent and mantissa, in float32 position
    exp = bits & U(0x0F800000)
    bits = bits + U(112 << 23)  # rebias the exponent: 127 - 15
    bits = bits + U(112 << 23) * U(exp == U(0x0F800000))  # inf / nan: exponent all ones
    value = u32_as_f32(np.uint32(bits | ((h & U(0x8000)) << U(16))))
    if exp == U(0):  # zero / subnormal (rare): renormalize through an exact float subtraction
        value = u32_as_f32(np.uint32(bits + U(1 << 23))) - u32_as_f32(np.uint32(113 << 23))
        if h & U(0x8000):
            value = -value
    return value


@njit(inline="always")
def bf16_to_f32(lo, hi):
    """bfloat16 (two little-endian bytes) -> float32: the top 16 bits of the float32."""
    return u32_as_f32(np.uint32((U(lo) << U(16)) | (U(hi) << U(24))))


@njit(cache=True, nogil=True)
def quantize_x(x, xq, xd, xs):
    """x float32 (n,) -> xq int8 (n,), xd float32 (n/32,) scales, xs int32 (n/16,) sums of xq.

    x ~= xd[i // 32] * xq[i]; |x - xd*xq| <= xd/2 = amax/254 per block (round to nearest).
    """
    for b in range(U(x.size // QK_X)):
        o = b * U(QK_X)
        amax = F32(0.0)
        for j in range(U(QK_X)):
            amax = max(amax, abs(x[o + j]))
        d = amax / F32(127.0)
        inv = F32(1.0) / d if d > F32(0.0) else F32(0.0)
        for half in range(U(2)):
            s = I32(0)
            for j in range(U(16)):
                q = I32(np.rint(x[o + half * U(16) + j] * inv))
                xq[o + half * U(16) + j] = q
                s += q
            xs[b * U(2) + half] = s
        xd[b] = d


def quantized_x(x):
    """Scratch for one product: x (n,) float32 -> (xq, xd, xs), see quantize_x."""
    n = x.shape[0]
    xq = np.empty(n, np.int8)
    xd = np.empty(n // QK_X, np.float32)
    xs = np.empty(n // 16, np.int32)
    quantize_x(x, xq, xd, xs)
    return xq, xd, xs




class QuantizedOps:
    """A family's entry points for the types in `kernels` (GGMLType -> (dequantize, matvec))."""

    def __init__(self, kernels):
        self.kernels = kernels

    def dequantize(self, ggml_type, raw, out):
        self.kernels[ggml_type][0](raw, out, LANES)

    def matvec(self, ggml_type, raw, x, out):
        xq, xd, xs = quantized_x(x)
        self.kernels[ggml_type][1](raw, xq, xd, xs, out, LANES)


# --- 16-lane integer dot products, written as portable LLVM vector IR ---------------------------
# LLVM does not vectorize a 16-iteration Numba loop well (it picks a 32-wide body and falls back to
# 4-wide remainder code); these emit the vector operations directly and LLVM lowers the widened
# multiply + reduce to pmaddwd-style code on x86 and to the NEON equivalents on ARM.
_V16 = 16


def _splat(builder, value, vec_type):
    vec = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, ir.Constant(vec_type, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), _V16), [0] * _V16))


def _load16(context, builder, arytype, ary, offset):
    """<16 x i8> loaded from ary.data + offset (no alignment assumed)."""
    data = context.make_array(arytype)(context, builder, ary).data
    ptr = builder.gep(data, [offset])
    vec_type = ir.VectorType(ir.IntType(8), _V16)
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=1)


def _reduce_add(builder, vec):
    name = f"llvm.vector.reduce.add.v{_V16}i32"
    fn = builder.module.globals.get(name) or ir.Function(
        builder.module, ir.FunctionType(ir.IntType(32), [vec.type]), name)
    return builder.call(fn, [vec])


@intrinsic
def dot16_field(typingctx, w, w_off, shift, mask, x, x_off):
    """int32 sum over j < 16 of ((w[w_off + j] >> shift) & mask) * x[x_off + j]; w uint8, x int8.

    The field must fit in 8 bits (mask <= 255), so every product fits in 16 bits.
    """
    sig = types.int32(w, types.uint64, types.int32, types.int32, x, types.uint64)

    def codegen(context, builder, signature, args):
        v32 = ir.VectorType(ir.IntType(32), _V16)
        wv = builder.zext(_load16(context, builder, signature.args[0], args[0], args[1]), v32)
        field = builder.and_(builder.lshr(wv, _splat(builder, args[2], v32)), _splat(builder, args[3], v32))
        xv = builder.sext(_load16(context, builder, signature.args[4], args[4], args[5]), v32)
        return _reduce_add(builder, builder.mul(field, xv))

    return sig, codegen


@intrinsic
def dot16_i8(typingctx, w, w_off, x, x_off):
    """int32 sum over j < 16 of int8(w[w_off + j]) * x[x_off + j]; w uint8 read as int8, x int8."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        v32 = ir.VectorType(ir.IntType(32), _V16)
        wv = builder.sext(_load16(context, builder, signature.args[0], args[0], args[1]), v32)
        xv = builder.sext(_load16(context, builder, signature.args[2], args[2], args[3]), v32)
        return _reduce_add(builder, builder.mul(wv, xv))

    return sig, codegen


@intrinsic
def dot16_bits(typingctx, bits, x, x_off):
    """int32 sum over j < 16 of ((bits >> j) & 1) * x[x_off + j]; bits a 16-bit mask, x int8."""
    sig = types.int32(types.int32, x, types.uint64)

    def codegen(context, builder, signature, args):
        v32 = ir.VectorType(ir.IntType(32), _V16)
        lanes = ir.Constant(v32, list(range(_V16)))
        field = builder.and_(builder.lshr(_splat(builder, args[0], v32), lanes), ir.Constant(v32, [1] * _V16))
        xv = builder.sext(_load16(context, builder, signature.args[1], args[1], args[2]), v32)
        return _reduce_add(builder, builder.mul(field, xv))

    return sig, codegen
