"""Pieces every kernel family shares: bit casts, f16 <-> f32, llama.cpp's activation formats, and
`outlined` (an intrinsic compiled as a function of its own). The IR building blocks live in `ir/`.

Activations (x of a product) are converted exactly as ggml's CPU backend converts them to the
weight type's `vec_dot_type` before every product (x86 / AVX2 rounding), so that products match
llama.cpp's to float32 summation order:
- "q8_32" (Q8_0 for Q4_0 / Q5_0 / Q8_0 weights, Q8_1 for Q4_1 / Q5_1): blocks of 32,
  d = amax / 127 stored as fp16, q = round-half-even(x * (127 / amax)); Q8_1 adds
  s = fp16(d * sum(q)) with the unrounded d. Parts (xq int8 (n,), xd float32 (n/32,) = fp16(d),
  xs int32 (n/32,) = sum(q), xm float32 (n/32,) = s).
- "q8_k" (Q8_K for the K-quants): blocks of 256; max = the value of largest magnitude (first one),
  iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale in float32, sums
  of q per 16. Parts (xq int8 (n,), xd float32 (n/256,), xs int32 (n/16,), xm unused (0,)).
- "f16" / "bf16": x rounded to half / bfloat16 (nearest even), kept as float32. Parts (xr,).
- "f32": x as is. Parts (x,).

How the kernels are written, and why (measured on an AVX2 machine, Numba 0.68 / LLVM 20):
- Indices are unsigned (`U`): Numba wraps negative signed indices with a per-element select,
  which stops LLVM from seeing contiguous loads. Integer locals are pinned to int32 (`I32`).
- The integer dot product of a block is one intrinsic emitting LLVM vector IR: on x86 with AVX2
  the u8 x s8 multiply-add instructions (pmaddubsw + pmaddwd, the per-16 scales folded into the
  pmaddwd); elsewhere portable widening multiplies and a reduction, which LLVM lowers for NEON.
- The float accumulation over blocks is kept in order (no reassociation), so results are the
  same bits on every call.
"""
from __future__ import annotations

import functools
import hashlib
import itertools

import numpy as np
from llvmlite import ir
from numba import njit, prange, types  # noqa: F401  (prange: re-exported to the families)
from numba.extending import intrinsic

from edgellm.kernels.cpu import use_cache_dir
from edgellm.kernels.cpu.host import F16C
from edgellm.kernels.cpu.ir.builder import llvm_fn
from edgellm.quants import KVALUES_IQ4NL

# Every kernel module imports this one before defining its kernels: the disk cache is the folder of
# this package's source digest however a module was reached (else a module imported directly would
# cache into __pycache__, keyed on its own date only, and run stale code after an edit in ir/).
use_cache_dir()

U = np.uint64
I32 = np.int32
F32 = np.float32

QK_X = 32  # "q8_32" activation block
QK_K = 256  # "q8_k" activation block
LANES = U(16)  # inner-loop trip count of the dequantize kernels, passed at run time

JIT = dict(cache=True, nogil=True, parallel=True)
# Every fast-math flag except reassociation: the block loop stays in order (deterministic).
FAST_IN_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


@intrinsic
def u32_as_f32(typingctx, bits):
    """Reinterpret the 32 bits of a uint32 as a float32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def f32_as_u32(typingctx, value):
    """Reinterpret the 32 bits of a float32 as a uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(inline="always")
def f16_to_f32(lo, hi):
    """IEEE half (two little-endian bytes) -> float32, exact for every input incl. inf/nan.

    Branch-free for normal numbers: scale signs are random in real weights, and a branch on the
    sign mispredicted half the time and made matvec far slower.
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


@intrinsic
def _load_f16_hw(typingctx, row, off):
    """float32 of the IEEE half at byte `off` of a uint8 array (hardware conversion, exact)."""
    sig = types.float32(row, types.uint64)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(16).as_pointer())
        half = builder.bitcast(builder.load(ptr, align=1), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return sig, codegen


if F16C:
    load_f16 = _load_f16_hw
else:
    @njit(inline="always")
    def load_f16(row, off):
        return f16_to_f32(row[off], row[off + U(1)])


@njit(inline="always")
def bf16_to_f32(lo, hi):
    """bfloat16 (two little-endian bytes) -> float32: the top 16 bits of the float32."""
    return u32_as_f32(np.uint32((U(lo) << U(16)) | (U(hi) << U(24))))


@njit(inline="always")
def f32_to_f16_bits(value):
    """float32 -> IEEE half bits (round to nearest even; overflow -> inf; nan stays nan)."""
    bits = U(f32_as_u32(value))
    sign = (bits >> U(16)) & U(0x8000)
    a = bits & U(0x7FFFFFFF)
    if a >= U(0x7F800000):  # inf / nan
        h = U(0x7C00) | (U(0x200) * U(a > U(0x7F800000)))
    elif a >= U(0x38800000):  # a normal half (or overflow): round the mantissa, carry ripples up
        a = a - U(112 << 23)
        h = min((a + U(0xFFF) + ((a >> U(13)) & U(1))) >> U(13), U(0x7C00))
    else:  # subnormal half or zero: scale by 2^24 (exact) and round half to even
        h = U(np.rint(u32_as_f32(np.uint32(a)) * F32(16777216.0)))
    return sign | h


@njit(inline="always")
def round_f16(value):
    """float32 rounded to the nearest half (ties to even), as float32."""
    h = f32_to_f16_bits(value)
    return f16_to_f32(h & U(0xFF), h >> U(8))


@njit(inline="always")
def round_bf16(value):
    """float32 rounded to the nearest bfloat16 (ties to even; nan stays nan), as float32."""
    u = U(f32_as_u32(value))
    if (u & U(0x7FFFFFFF)) > U(0x7F800000):
        return u32_as_f32(np.uint32(((u >> U(16)) | U(64)) << U(16)))
    return u32_as_f32(np.uint32(((u + U(0x7FFF) + ((u >> U(16)) & U(1))) >> U(16)) << U(16)))


# --- activation quantizers (one vector; rows of a matrix go through the *_rows kernels) -------
@njit(inline="always")
def _q8_32_block(x, o, xq, xd, xs, xm, b):
    amax = F32(0.0)
    for j in range(U(QK_X)):
        amax = max(amax, abs(x[o + j]))
    d = amax / F32(127.0)
    inv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
    s = I32(0)
    for j in range(U(QK_X)):
        q = I32(np.rint(x[o + j] * inv))
        xq[o + j] = q
        s += q
    xd[b] = round_f16(d)
    xs[b] = s
    xm[b] = round_f16(d * F32(s))


@njit(inline="always")
def _q8_k_block(x, o, xq, xd, xs, b):
    amax = F32(0.0)
    vmax = F32(0.0)
    for j in range(U(QK_K)):
        ax = abs(x[o + j])
        if ax > amax:
            amax = ax
            vmax = x[o + j]
    if amax == F32(0.0):
        for j in range(U(QK_K)):
            xq[o + j] = 0
        for g in range(U(16)):
            xs[b * U(16) + g] = 0
        xd[b] = F32(0.0)
        return
    iscale = F32(-127.0) / vmax
    for g in range(U(16)):
        s = I32(0)
        for j in range(o + U(16) * g, o + U(16) * g + U(16)):
            q = min(I32(np.rint(iscale * x[j])), I32(127))
            xq[j] = q
            s += q
        xs[b * U(16) + g] = s
    xd[b] = F32(1.0) / iscale


@njit(cache=True, nogil=True)
def quantize_q8_32(x, xq, xd, xs, xm):
    """x float32 (n,) -> the "q8_32" parts (see the module docstring)."""
    for b in range(U(x.size // QK_X)):
        _q8_32_block(x, b * U(QK_X), xq, xd, xs, xm, b)


@njit(cache=True, nogil=True)
def quantize_q8_k(x, xq, xd, xs, xm):
    """x float32 (n,) -> the "q8_k" parts (see the module docstring); xm is unused."""
    for b in range(U(x.size // QK_K)):
        _q8_k_block(x, b * U(QK_K), xq, xd, xs, b)


# A prompt batch (all its tokens' rows as one x) in parallel: the same blocks, split between threads.
@njit(cache=True, nogil=True, parallel=True)
def quantize_q8_32_batch(x, xq, xd, xs, xm):
    for b in prange(U(x.size // QK_X)):
        _q8_32_block(x, b * U(QK_X), xq, xd, xs, xm, b)


@njit(cache=True, nogil=True, parallel=True)
def quantize_q8_k_batch(x, xq, xd, xs, xm):
    for b in prange(U(x.size // QK_K)):
        _q8_k_block(x, b * U(QK_K), xq, xd, xs, b)


@njit(cache=True, nogil=True)
def quantize_f16(x, out):
    for j in range(U(x.size)):
        out[j] = round_f16(x[j])


@njit(cache=True, nogil=True)
def quantize_bf16(x, out):
    for j in range(U(x.size)):
        out[j] = round_bf16(x[j])


# x (n_tok, n) -> out (n_tok, n): each row quantized as above and dequantized back to float32
# (exact for the fp16-scaled formats; q8_k rounds d * q once), the input of the BLAS products.
# One thread: the work is tiny, and a parallel region right after a BLAS call waits for
# OpenBLAS's still-spinning threads.
SERIAL = dict(cache=True, nogil=True)


@njit(**SERIAL)
def requantize_rows_q8_32(x, out):
    for r in range(x.shape[0]):
        row, dst = x[r], out[r]
        for o in range(U(0), U(x.shape[1]), U(QK_X)):
            amax = F32(0.0)
            for j in range(o, o + U(QK_X)):
                amax = max(amax, abs(row[j]))
            d = round_f16(amax / F32(127.0))
            inv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
            for j in range(o, o + U(QK_X)):
                dst[j] = d * np.rint(row[j] * inv)


@njit(**SERIAL)
def requantize_rows_q8_k(x, out):
    for r in range(x.shape[0]):
        row, dst = x[r], out[r]
        for o in range(U(0), U(x.shape[1]), U(QK_K)):
            amax = F32(0.0)
            vmax = F32(0.0)
            for j in range(o, o + U(QK_K)):
                if abs(row[j]) > amax:
                    amax = abs(row[j])
                    vmax = row[j]
            iscale = F32(-127.0) / vmax if amax != F32(0.0) else F32(0.0)
            d = F32(1.0) / iscale if amax != F32(0.0) else F32(0.0)
            for j in range(o, o + U(QK_K)):
                dst[j] = d * min(np.rint(iscale * row[j]), F32(127.0))


@njit(**SERIAL)
def requantize_rows_f16(x, out):
    for r in range(x.shape[0]):
        row, dst = x[r], out[r]
        for j in range(U(x.shape[1])):
            dst[j] = round_f16(row[j])


@njit(**SERIAL)
def requantize_rows_bf16(x, out):
    for r in range(x.shape[0]):
        row, dst = x[r], out[r]
        for j in range(U(x.shape[1])):
            dst[j] = round_bf16(row[j])


_OUTLINED = itertools.count()


def outlined(kernel):
    """The intrinsic `kernel` compiled as a function of its own (internal, never inlined) that its
    callers call, instead of inlined into them: the same code, so the same results. For callers
    that inline many row kernels into one large function (fused.decode_layers): there, inlined, a
    kernel's loop shares the register allocation of the whole caller, whose hoisted constants and
    live values spill around it (docs/performance.md, standing decisions). A call per row costs
    little next to a row of a few thousand columns, but not next to a small model's short rows
    (fused.py outlines the K-quants' kernels only)."""
    defn = kernel.__wrapped__
    tag = f"edgellm.{defn.__name__}.{next(_OUTLINED)}"

    @functools.wraps(defn)
    def typer(typingctx, *args):
        typed = defn(typingctx, *args)
        if typed is None:
            return None
        sig, codegen = typed

        def call(context, builder, signature, args):
            name = f"{tag}.{hashlib.sha1(str(signature).encode()).hexdigest()[:12]}"
            fn = llvm_fn(builder, name, context.get_value_type(signature.return_type), [a.type for a in args])
            if fn.is_declaration:
                fn.linkage = "internal"
                fn.attributes.add("noinline")
                body = ir.IRBuilder(fn.append_basic_block("entry"))
                body.ret(codegen(context, body, signature, list(fn.args)))
            return builder.call(fn, args)

        return sig, call

    return intrinsic(typer)


# --- shared by the IQ families (iquants, igrid) ---------------------------------------------
KVALUES = np.array(KVALUES_IQ4NL, np.int32)  # ggml's kvalues_iq4nl


@njit(inline="always")
def hsum8(a):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    r0, r1, r2, r3 = a[4] + a[0], a[5] + a[1], a[6] + a[2], a[7] + a[3]
    return (r0 + r2) + (r1 + r3)


@njit(inline="always")
def xs_scale(row, o, s):
    """ls - 32 of sub-block s (0..7) of the IQ4_XS super-block at byte o."""
    sh = I32(row[o + U(2)]) | (I32(row[o + U(3)]) << I32(8))
    lo = (I32(row[o + U(4) + (s >> U(1))]) >> I32(4 * (s & U(1)))) & I32(15)
    return (lo | (((sh >> I32(2 * s)) & I32(3)) << I32(4))) - I32(32)
