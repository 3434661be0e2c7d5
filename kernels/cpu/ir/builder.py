"""The LLVM IR building blocks every kernel intrinsic is made of: vector types, loads, splats,
the u8 x s8 multiply-adds (pmaddubsw / pmaddwd / vpdpbusd, or portable widening products), the
pairwise reductions, prefetches and the block loop.

Each helper emits IR into the caller's builder; the intrinsics built from them (legacy, kquants,
tiles, rows8, packed, dense, attention, unpack, vecmath) are what @njit code calls. Without AVX2 the
same helpers emit portable vector ops (the integer part is exact either way).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import AVX2, F16C, SOFTWARE_PREFETCH, VNNI, ZMM_VNNI

I32_T = ir.IntType(32)


def i8(n):
    return ir.VectorType(ir.IntType(8), n)


def i16(n):
    return ir.VectorType(ir.IntType(16), n)


def i32(n):
    return ir.VectorType(ir.IntType(32), n)


def llvm_fn(builder, name, ret, params):
    return builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ret, params), name)


def splat(builder, value, vec_type):
    vec = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, ir.Constant(vec_type, ir.Undefined),
                                  ir.Constant(i32(vec_type.count), [0] * vec_type.count))


def load_bytes(context, builder, arytype, ary, offset, n):
    """<n x i8> loaded from ary.data + offset (no alignment assumed)."""
    data = context.make_array(arytype)(context, builder, ary).data
    ptr = builder.gep(data, [offset])
    return builder.load(builder.bitcast(ptr, i8(n).as_pointer()), align=1)


def field(builder, vec, shift, mask):
    """(vec >> shift) & mask on <n x i8> (shift, mask int32 scalars)."""
    n = vec.type.count
    shift8 = splat(builder, builder.trunc(shift, ir.IntType(8)), i8(n))
    mask8 = splat(builder, builder.trunc(mask, ir.IntType(8)), i8(n))
    return builder.and_(builder.lshr(vec, shift8), mask8)


def abs_sign(builder, w, x):
    """(|w| as u8, x * sign(w) as s8): the u8 x s8 form of an s8 x s8 product."""
    if AVX2:
        sign = llvm_fn(builder, "llvm.x86.avx2.psign.b", i8(32), [i8(32), i8(32)])
        return builder.call(sign, [w, w]), builder.call(sign, [x, w])
    zero = ir.Constant(i8(32), [0] * 32)
    neg = builder.icmp_signed("<", w, zero)
    pos = builder.icmp_signed(">", w, zero)
    absw = builder.select(neg, builder.sub(zero, w), w)
    sx = builder.select(neg, builder.sub(zero, x), builder.select(pos, x, zero))
    return absw, sx


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 a * b + c with one rounding (llvm.fma; one instruction with FMA hardware)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        return builder.call(llvm_fn(builder, "llvm.fma.f32", f, [f, f, f]), list(args))

    return sig, codegen


def fma8_vec(context, builder, signature, a, b, acc_arg, acc_index):
    """acc[0:8] = fma(a, b, acc) (<8 x float> a, b; float32 lanes, one rounding each)."""
    f8 = ir.VectorType(ir.FloatType(), 8)
    data = context.make_array(signature.args[acc_index])(context, builder, acc_arg).data
    ptr = builder.bitcast(data, f8.as_pointer())
    fma = llvm_fn(builder, "llvm.fma.v8f32", f8, [f8, f8, f8])
    builder.store(builder.call(fma, [a, b, builder.load(ptr, align=4)]), ptr, align=4)


def fma8(context, builder, signature, d, ints, acc_arg, acc_index):
    """acc[0:8] = fma(d, f32(ints), acc) (float32 lanes, one rounding each)."""
    f8 = ir.VectorType(ir.FloatType(), 8)
    fma8_vec(context, builder, signature, splat(builder, d, f8), builder.sitofp(ints, f8), acc_arg, acc_index)


@intrinsic
def fma_ints(typingctx, d, iq, acc):
    """acc[0:8] (float32) = fma(d, f32(iq[0:8]), acc) lane by lane; iq (int32) set to zero."""
    sig = types.none(types.float32, iq, acc)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[1])(context, builder, args[1]).data
        ptr = builder.bitcast(data, i32(8).as_pointer())
        fma8(context, builder, signature, args[0], builder.load(ptr, align=4), args[2], 2)
        builder.store(ir.Constant(i32(8), [0] * 8), ptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


def vec_ptr(builder, base, offset):
    return builder.bitcast(builder.gep(base, [offset]), ir.VectorType(ir.FloatType(), 8).as_pointer())


# One-row K-quant kernels read a row linearly, one super-block a loop; from memory the hardware's
# prefetch alone left them latency-bound on Intel cores, so they prefetch (into L2) ROW_AHEAD bytes
# ahead (into the next rows at a row's end: rows lie end to end), the best distance measured there;
# 0 (none) where host.SOFTWARE_PREFETCH is off: on AMD Zen it slowed them (docs/performance.md).
ROW_AHEAD = 2816 if SOFTWARE_PREFETCH else 0


def prefetch(builder, wp, o, n):
    """Prefetch bytes [o, o + n + 64) of wp into L2 (prefetcht1): a prefetch never faults, so
    reading ahead past the array's end is harmless."""
    fn = llvm_fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32),
                                                          ir.IntType(32), ir.IntType(32)])
    for k in range(0, n + 1, 64):
        builder.call(fn, [builder.gep(wp, [builder.add(o, ir.Constant(ir.IntType(64), k))]),
                          ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 2),
                          ir.Constant(ir.IntType(32), 1)])


def prefetch_row(builder, wp, o, block):
    """In a one-row kernel at the super-block at byte o (of `block` bytes): the one ROW_AHEAD on."""
    if ROW_AHEAD:
        prefetch(builder, wp, builder.add(o, ir.Constant(ir.IntType(64), ROW_AHEAD)), block - 1)


F32_T = ir.FloatType()


I64_T = ir.IntType(64)


V8F = ir.VectorType(F32_T, 8)


F32X4 = ir.VectorType(F32_T, 4)


def const(v):
    """An i64 constant (offsets and sizes in the IR below)."""
    return ir.Constant(I64_T, v)


def array_ptr(context, builder, arytype, ary):
    return context.make_array(arytype)(context, builder, ary).data


def load_vec(builder, base, offset, vec_type):
    ptr = builder.bitcast(builder.gep(base, [offset]), vec_type.as_pointer())
    return builder.load(ptr, align=1)


def load_half(builder, base, offset):
    """float32 of the IEEE half at base[offset] (bytes): one vcvtph2ps with F16C, else
    common.f16_to_f32's integer steps (LLVM would call a runtime function Numba does not link)."""
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.IntType(16).as_pointer())
    h16 = builder.load(ptr, align=1)
    if F16C:
        return builder.fpext(builder.bitcast(h16, ir.HalfType()), F32_T)
    i32_t = ir.IntType(32)

    def c(v):
        return ir.Constant(i32_t, v)

    h = builder.zext(h16, i32_t)
    bits = builder.shl(builder.and_(h, c(0x7FFF)), c(13))
    exp = builder.and_(bits, c(0x0F800000))
    bits = builder.add(bits, c(112 << 23))
    bits = builder.add(bits, builder.select(builder.icmp_unsigned("==", exp, c(0x0F800000)), c(112 << 23), c(0)))
    sign = builder.shl(builder.and_(h, c(0x8000)), c(16))
    normal = builder.bitcast(builder.or_(bits, sign), F32_T)
    sub = builder.fsub(builder.bitcast(builder.add(bits, c(1 << 23)), F32_T), builder.bitcast(c(113 << 23), F32_T))
    sub = builder.select(builder.icmp_unsigned("!=", sign, c(0)), builder.fneg(sub), sub)
    return builder.select(builder.icmp_unsigned("==", exp, c(0)), sub, normal)


def fma(builder, a, b, c):
    t = a.type
    name = "llvm.fma.f32" if t == F32_T else f"llvm.fma.v{t.count}f32"
    return builder.call(llvm_fn(builder, name, t, [t, t, t]), [a, b, c])


def dpbusd(builder, acc, u8, s8):
    """<n x i32>: acc + lane j's four products u8[4j+k] * s8[4j+k] of <4n x i8> u8 / s8 (n = 8 or
    16): one vpdpbusd where the CPU has it at that width (VNNI / ZMM_VNNI), else the same integers
    from portable IR."""
    n = acc.type.count
    vi = i32(n)
    if (n == 16 and ZMM_VNNI) or (n == 8 and VNNI):
        # the multiplicands as <n x i32>: LLVM before 21 declares them so, later ones upgrade the call
        fn = llvm_fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", vi, [vi] * 3)
        return builder.call(fn, [acc, builder.bitcast(u8, vi), builder.bitcast(s8, vi)])
    prod = builder.mul(builder.zext(u8, i32(4 * n)), builder.sext(s8, i32(4 * n)))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(i32(n), [4 * j + k for j in range(n)]))
             for k in range(4)]
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


def quad_sums(builder, u8, s8):
    """<8 x i32>: lane j = sum_{k<4} u8[4j+k] * s8[4j+k] (u8 unsigned, s8 signed; pair sums fit
    int16, as pmaddubsw requires). The same integers from one vpdpbusd where the CPU has it."""
    if AVX2 and not VNNI:
        pairs = builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", i16(16), [i8(32), i8(32)]), [u8, s8])
        ones = ir.Constant(i16(16), [1] * 16)
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", i32(8), [i16(16), i16(16)]), [pairs, ones])
    return dpbusd(builder, ir.Constant(i32(8), [0] * 8), u8, s8)  # vpdpbusd, or portable IR


def nibbles(builder, base, offset):
    """<32 x i8>: the 16 bytes at offset, low nibbles (weights 0..15) then high (16..31)."""
    raw = load_vec(builder, base, offset, i8(16))
    both = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(i8(16), [4] * 16)),
                                  ir.Constant(i32(32), list(range(32))))
    return builder.and_(both, ir.Constant(i8(32), [15] * 32))


def hsum8(builder, acc):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    def lane(v, i):
        return builder.extract_element(v, ir.Constant(ir.IntType(32), i))

    r = [builder.fadd(lane(acc, i + 4), lane(acc, i)) for i in range(4)]
    return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))


def block_loop(context, builder, nb, body):
    """acc (<8 x float>) and a scalar sum over nb blocks; body(i, acc, s) -> (acc, s)."""
    acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8))
    s_ptr = cgutils.alloca_once_value(builder, ir.Constant(F32_T, 0.0))
    with cgutils.for_range(builder, nb) as loop:
        acc, s = body(loop.index, builder.load(acc_ptr), builder.load(s_ptr))
        builder.store(acc, acc_ptr)
        builder.store(s, s_ptr)
    return builder.load(acc_ptr), builder.load(s_ptr)


def pair_adds(builder, v):
    """<4 x i32>: v[2c] + v[2c + 1] of a <8 x i32>."""
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(i32(4), [0, 2, 4, 6])),
                       builder.shuffle_vector(v, v, ir.Constant(i32(4), [1, 3, 5, 7])))


def reduce4(builder, vs):
    """<4 x i32>: the lane sums of four <8 x i32> (integers: any order is exact), in three rounds
    of shuffles and adds instead of four full reductions."""
    def fold(a, b, lo, hi):
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(i32(8), lo)),
                           builder.shuffle_vector(a, b, ir.Constant(i32(8), hi)))

    a = fold(vs[0], vs[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
    b = fold(vs[2], vs[3], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
    return pair_adds(builder, fold(a, b, [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]))


def madd16(builder, a, b):
    """<8 x i32>: lane j = a[2j] b[2j] + a[2j+1] b[2j+1] of two <16 x i16> (pmaddwd)."""
    if AVX2:
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.wd", i32(8), [i16(16), i16(16)]), [a, b])
    prod = builder.mul(builder.sext(a, i32(16)), builder.sext(b, i32(16)))
    return builder.add(builder.shuffle_vector(prod, prod, ir.Constant(i32(8), list(range(0, 16, 2)))),
                       builder.shuffle_vector(prod, prod, ir.Constant(i32(8), list(range(1, 16, 2)))))


# --- eight tokens at a time, the whole row: the tiled product's float steps as lanes -----------
def reduce8(builder, vs):
    """<8 x i32>: lane t = the lane sum of vs[t], for eight <8 x i32> (integers: any order is
    exact): unpack-and-add rounds within the 128-bit halves, then the halves added."""
    def sh(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(i32(8), mask))

    def four(a, b, c, d):  # [a b c d] sums of the low halves | of the high halves
        ab = builder.add(sh(a, b, [0, 8, 1, 9, 4, 12, 5, 13]), sh(a, b, [2, 10, 3, 11, 6, 14, 7, 15]))
        cd = builder.add(sh(c, d, [0, 8, 1, 9, 4, 12, 5, 13]), sh(c, d, [2, 10, 3, 11, 6, 14, 7, 15]))
        return builder.add(sh(ab, cd, [0, 1, 8, 9, 4, 5, 12, 13]), sh(ab, cd, [2, 3, 10, 11, 6, 7, 14, 15]))

    lo, hi = four(*vs[:4]), four(*vs[4:])
    return builder.add(sh(lo, hi, [0, 1, 2, 3, 8, 9, 10, 11]), sh(lo, hi, [4, 5, 6, 7, 12, 13, 14, 15]))


def fold16(builder, v):
    """<8 x i32>: v[j] + v[j + 8] of a <16 x i32>."""
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(i32(8), list(range(8)))),
                       builder.shuffle_vector(v, v, ir.Constant(i32(8), list(range(8, 16)))))


def pair_splat(builder, base, offset):
    """<16 x i16>: the two int16 at base[offset], base[offset + 1] repeated eight times."""
    pair = load_vec(builder, base, offset, i16(2))
    return builder.shuffle_vector(pair, pair, ir.Constant(i32(16), [0, 1] * 8))


def load_v8f(builder, base, offset, half):
    """8 floats at element offset of a float32 array, or of float16 bits (uint16), widened."""
    if not half:
        return load_vec(builder, base, offset, V8F)
    raw = load_vec(builder, base, offset, ir.VectorType(ir.IntType(16), 8))
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8)), V8F)


def maddubs16(builder, u8, s8):
    """<16 x i16>: lane j = u8[2j] s8[2j] + u8[2j+1] s8[2j+1] (pmaddubsw; u8 small, no saturation)."""
    if AVX2:
        return builder.call(llvm_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", i16(16), [i8(32), i8(32)]), [u8, s8])
    prod = builder.mul(builder.zext(u8, i16(32)), builder.sext(s8, i16(32)))
    return builder.add(builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(0, 32, 2)))),
                       builder.shuffle_vector(prod, prod, ir.Constant(i32(16), list(range(1, 32, 2)))))
