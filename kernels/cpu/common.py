"""Pieces every kernel family shares: bit casts, f16 <-> f32, llama.cpp's activation formats, and
the integer dot products of one block.

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

import numba
import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types  # noqa: F401  (prange: re-exported to the families)
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu import use_cache_dir

# Every kernel module imports this one before defining its kernels: the disk cache is the folder of
# this package's source digest however a module was reached (a direct `import
# edgellm.kernels.cpu.legacy` used to cache into __pycache__, keyed on legacy.py's own date only,
# and then ran stale machine code after an edit of rows8.py or rowdot.py).
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


def _host_features() -> set[str]:
    if numba.config.CPU_NAME not in (None, "host"):
        return set()  # cross-compiling for a generic CPU: portable IR only
    # NUMBA_CPU_FEATURES, when set, is what LLVM compiles for (e.g. the host less AVX-512)
    flat = numba.config.CPU_FEATURES or llvm_binding.get_host_cpu_features().flatten()
    return {f[1:] for f in flat.split(",") if f[:1] == "+"}


_FEATURES = _host_features()
AVX2 = "avx2" in _FEATURES
# vpdpbusd: four u8 x s8 products summed into each int32 lane in one instruction (AVX-VNNI, or
# AVX-512 VNNI with 256-bit forms)
VNNI = AVX2 and ("avxvnni" in _FEATURES or {"avx512vnni", "avx512vl"} <= _FEATURES)
# AVX-512 with 256-bit forms: 32 vector registers (AVX2 has 16), room for constants kept in them
REGS32 = AVX2 and {"avx512f", "avx512vl"} <= _FEATURES
# 512-bit byte ops and vpdpbusd (two tokens' blocks in one vector: rowdot._q8_0_two_rows)
ZMM_VNNI = REGS32 and {"avx512bw", "avx512vnni"} <= _FEATURES
# Software prefetch of the weights a decode kernel reads next (rowdot.ROW_AHEAD, rows8.PACKED_AHEAD,
# rows8.GROUP_AHEAD): on Intel cores it keeps the one-row K-quant kernels from being latency-bound;
# on AMD Zen cores the prefetches cost instead (measured: docs/performance.md, standing decisions).
# LLVM's name for the CPU compiled for: "znver1" .. "znver5" on AMD Zen.
_CPU_NAME = (llvm_binding.get_host_cpu_name() if numba.config.CPU_NAME in (None, "host") else numba.config.CPU_NAME)
SOFTWARE_PREFETCH = not _CPU_NAME.startswith("znver")
F16C = "f16c" in _FEATURES or "fp-armv8" in _FEATURES or "neon" in _FEATURES


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


# --- integer dot products of one block, as LLVM vector IR ----------------------------------------
def _i8(n):
    return ir.VectorType(ir.IntType(8), n)


def _i16(n):
    return ir.VectorType(ir.IntType(16), n)


def _i32(n):
    return ir.VectorType(ir.IntType(32), n)


def _fn(builder, name, ret, params):
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ret, params), name)


_OUTLINED = itertools.count()


def outlined(kernel):
    """The intrinsic `kernel` compiled as a function of its own (internal, never inlined) that its
    callers call, instead of inlined into them: the same code, so the same results. For callers
    that inline many row kernels into one large function (fused.decode_layers): there, inlined, a
    kernel's loop shares the register allocation of the whole caller, whose hoisted constants and
    live values spill around it (measured: docs/performance.md, standing decisions). A call per row costs little next to a row of a few
    thousand columns, but not next to a small model's short rows (fused.py outlines the K-quants'
    kernels only)."""
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
            fn = _fn(builder, name, context.get_value_type(signature.return_type), [a.type for a in args])
            if fn.is_declaration:
                fn.linkage = "internal"
                fn.attributes.add("noinline")
                body = ir.IRBuilder(fn.append_basic_block("entry"))
                body.ret(codegen(context, body, signature, list(fn.args)))
            return builder.call(fn, args)

        return sig, call

    return intrinsic(typer)


def _splat(builder, value, vec_type):
    vec = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, ir.Constant(vec_type, ir.Undefined),
                                  ir.Constant(_i32(vec_type.count), [0] * vec_type.count))


def _load(context, builder, arytype, ary, offset, n):
    """<n x i8> loaded from ary.data + offset (no alignment assumed)."""
    data = context.make_array(arytype)(context, builder, ary).data
    ptr = builder.gep(data, [offset])
    return builder.load(builder.bitcast(ptr, _i8(n).as_pointer()), align=1)


def _field(builder, vec, shift, mask):
    """(vec >> shift) & mask on <n x i8> (shift, mask int32 scalars)."""
    n = vec.type.count
    shift8 = _splat(builder, builder.trunc(shift, ir.IntType(8)), _i8(n))
    mask8 = _splat(builder, builder.trunc(mask, ir.IntType(8)), _i8(n))
    return builder.and_(builder.lshr(vec, shift8), mask8)


def _scaled_sum(builder, u8, s8, sc0, sc1):
    """int32: sc0 * sum_{j<16} u8[j] * s8[j] + sc1 * sum_{16<=j<32} ...; u8 (<32 x i8>) in
    0..127 unsigned, s8 signed, |sc| <= 128 (pair sums of products fit int16)."""
    if AVX2:
        pairs = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _i16(16), [_i8(32), _i8(32)]), [u8, s8])
        scales = builder.shuffle_vector(
            _splat(builder, builder.trunc(sc0, ir.IntType(16)), _i16(16)),
            _splat(builder, builder.trunc(sc1, ir.IntType(16)), _i16(16)),
            ir.Constant(_i32(16), list(range(8)) + list(range(24, 32))))
        quads = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _i32(8), [_i16(16), _i16(16)]), [pairs, scales])
    else:
        prod = builder.mul(builder.zext(u8, _i32(32)), builder.sext(s8, _i32(32)))
        scales = builder.shuffle_vector(_splat(builder, sc0, _i32(32)), _splat(builder, sc1, _i32(32)),
                                        ir.Constant(_i32(32), list(range(16)) + list(range(48, 64))))
        quads = builder.mul(prod, scales)
    n = quads.type.count
    return builder.call(_fn(builder, f"llvm.vector.reduce.add.v{n}i32", ir.IntType(32), [quads.type]), [quads])


def _abs_sign(builder, w, x):
    """(|w| as u8, x * sign(w) as s8): the u8 x s8 form of an s8 x s8 product."""
    if AVX2:
        sign = _fn(builder, "llvm.x86.avx2.psign.b", _i8(32), [_i8(32), _i8(32)])
        return builder.call(sign, [w, w]), builder.call(sign, [x, w])
    zero = ir.Constant(_i8(32), [0] * 32)
    neg = builder.icmp_signed("<", w, zero)
    pos = builder.icmp_signed(">", w, zero)
    absw = builder.select(neg, builder.sub(zero, w), w)
    sx = builder.select(neg, builder.sub(zero, x), builder.select(pos, x, zero))
    return absw, sx


_ONE = ir.Constant(ir.IntType(32), 1)


@intrinsic
def dot32_field(typingctx, w, w_off, shift, mask, x, x_off, sc0, sc1):
    """int32 sum_{j<32} sc(j) * ((w[w_off + j] >> shift) & mask) * x[x_off + j], sc(j) = sc0 for
    j < 16 else sc1; w uint8, x int8, mask <= 127."""
    sig = types.int32(w, types.uint64, types.int32, types.int32, x, types.uint64, types.int32, types.int32)

    def codegen(context, builder, signature, args):
        wv = _field(builder, _load(context, builder, signature.args[0], args[0], args[1], 32), args[2], args[3])
        xv = _load(context, builder, signature.args[4], args[4], args[5], 32)
        return _scaled_sum(builder, wv, xv, args[6], args[7])

    return sig, codegen


@intrinsic
def dot32_q4(typingctx, w, w_off, x, x_off):
    """int32 sum_{j<16} (w[w_off + j] & 15) * x[x_off + j] + (w[w_off + j] >> 4) * x[x_off + 16 + j]:
    the 16 nibble bytes of a Q4_0 / Q4_1 block against 32 int8 values."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        raw = _load(context, builder, signature.args[0], args[0], args[1], 16)
        nib = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(_i8(16), [4] * 16)),
                                     ir.Constant(_i32(32), list(range(32))))
        wv = builder.and_(nib, ir.Constant(_i8(32), [15] * 32))
        xv = _load(context, builder, signature.args[2], args[2], args[3], 32)
        return _scaled_sum(builder, wv, xv, _ONE, _ONE)

    return sig, codegen


@intrinsic
def dot32_q5(typingctx, w, w_off, qh, x, x_off):
    """As dot32_q4 with bit j of qh (uint32) as the 5th bit of weight j (0 <= j < 32)."""
    sig = types.int32(w, types.uint64, types.uint32, x, types.uint64)

    def codegen(context, builder, signature, args):
        raw = _load(context, builder, signature.args[0], args[0], args[1], 16)
        nib = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(_i8(16), [4] * 16)),
                                     ir.Constant(_i32(32), list(range(32))))
        # byte j // 8 of qh into lane j, tested against bit j % 8: 16 where set (shuffle + compare)
        qh_bytes = builder.bitcast(args[2], _i8(4))
        spread = builder.shuffle_vector(qh_bytes, ir.Constant(_i8(4), ir.Undefined),
                                        ir.Constant(_i32(32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, ir.Constant(_i8(32), [1 << (j % 8) for j in range(32)]))
        high = builder.select(builder.icmp_unsigned("!=", bit, ir.Constant(_i8(32), [0] * 32)),
                              ir.Constant(_i8(32), [16] * 32), ir.Constant(_i8(32), [0] * 32))
        wv = builder.or_(builder.and_(nib, ir.Constant(_i8(32), [15] * 32)), high)
        xv = _load(context, builder, signature.args[3], args[3], args[4], 32)
        return _scaled_sum(builder, wv, xv, _ONE, _ONE)

    return sig, codegen


@intrinsic
def dot32_i8(typingctx, w, w_off, x, x_off):
    """int32 sum_{j<32} int8(w[w_off + j]) * x[x_off + j]; w uint8 read as int8, x int8."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        wv = _load(context, builder, signature.args[0], args[0], args[1], 32)
        xv = _load(context, builder, signature.args[2], args[2], args[3], 32)
        absw, sx = _abs_sign(builder, wv, xv)
        return _scaled_sum(builder, absw, sx, _ONE, _ONE)

    return sig, codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 a * b + c with one rounding (llvm.fma; one instruction with FMA hardware)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        return builder.call(_fn(builder, "llvm.fma.f32", f, [f, f, f]), list(args))

    return sig, codegen


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
    f, v = ir.FloatType(), ir.VectorType(ir.FloatType(), 8)
    vi = ir.VectorType(ir.IntType(32), 8)

    def c(value):
        return ir.Constant(v, [float(value)] * 8)

    def ci(value):
        return ir.Constant(vi, [value] * 8)

    fma = _fn(builder, "llvm.fma.v8f32", v, [v, v, v])
    fabs = _fn(builder, "llvm.fabs.v8f32", v, [v])
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


def _vec_ptr(builder, base, offset):
    return builder.bitcast(builder.gep(base, [offset]), ir.VectorType(ir.FloatType(), 8).as_pointer())


@intrinsic
def exp_shifted(typingctx, s, n, m):
    """s[j] = expf_ggml(s[j] - m) for j < n (a multiple of 8), 0 where s[j] is -inf (a masked
    score), eight lanes at a time; s float32."""
    sig = types.void(s, types.uint64, types.float32)

    def codegen(context, builder, signature, args):
        s_, n_, m_ = args
        sp = context.make_array(signature.args[0])(context, builder, s_).data
        v = ir.VectorType(ir.FloatType(), 8)
        mv = _splat(builder, m_, v)
        inf = ir.Constant(v, [float("-inf")] * 8)
        with cgutils.for_range(builder, builder.udiv(n_, ir.Constant(ir.IntType(64), 8))) as loop:
            ptr = _vec_ptr(builder, sp, builder.mul(loop.index, ir.Constant(ir.IntType(64), 8)))
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
            g = builder.load(_vec_ptr(builder, gp, o), align=4)
            e = _expf_ggml_v8(builder, builder.fneg(g))
            r = builder.fmul(builder.fdiv(g, builder.fadd(one, e)), builder.load(_vec_ptr(builder, up_, o), align=4))
            builder.store(r, _vec_ptr(builder, op, o), align=4)
        return context.get_dummy_value()

    return sig, codegen
