"""Dot products of a weight row with an activation row, summed in the order ggml's x86 CPU code
sums them: the whole loop over blocks is one intrinsic that emits LLVM vector IR.

Why: the small models edgellm targets have outlier activations that turn a float32 rounding
difference of 1e-7 in one product into differences of 0.1-1 in the logits (measured on SmolLM2:
a decode step summed block by block into one float differed from llama.cpp's by 0.2 at the first
position). Following ggml's order makes a product the same bits as llama.cpp's; it is also the fast
order: eight float lanes, no horizontal sum per block.

ggml's AVX2 `vec_dot` for the legacy types, per block b of 32 weights:
    lanes (8 x int32)  lane j = sum of the integer products of weights 4j .. 4j+3 (u8 x s8
                        multiply-add pairs, then pairs of pairs: pmaddubsw + pmaddwd)
    acc  = fma(splat(d_w * d_x), float(lanes), acc)            (8 float lanes)
    Q4_1 / Q5_1 also: summs = fma(m_w, s_x, summs)            (one float, in block order)
result = ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3))  [+ summs]

Entry points (Numba intrinsics, usable inside @njit code):
    rowdot_q4_1(w, w_off, xq, x_off, xd, xm, b_off, nb) -> float32
    rowdot_q8_0(w, w_off, xq, x_off, xd, b_off, nb)     -> float32
w: uint8 weights (row at byte w_off), xq: int8 activations (block i at x_off + 32 i), xd / xm:
float32 per-block activation scale / Q8_1 sum (block i at b_off + i), nb: number of blocks.
Without AVX2 the same IR is emitted with portable vector ops (the integer part is exact either
way; the float order stays ggml's x86 order).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.common import (AVX2, REGS32, SOFTWARE_PREFETCH, VNNI, ZMM_VNNI, _abs_sign, _fn, _i8, _i16, _i32,
                                       _splat)

# One-row K-quant kernels read a row linearly, one super-block a loop; from memory the hardware's
# prefetch alone left them latency-bound on Intel cores, so they prefetch (into L2) ROW_AHEAD bytes
# ahead (into the next rows at a row's end: rows lie end to end), the best distance measured there;
# 0 (none) where common.SOFTWARE_PREFETCH is off: on AMD Zen it slowed them (docs/performance.md).
ROW_AHEAD = 2816 if SOFTWARE_PREFETCH else 0


def _prefetch(builder, wp, o, n):
    """Prefetch bytes [o, o + n + 64) of wp into L2 (prefetcht1): a prefetch never faults, so
    reading ahead past the array's end is harmless."""
    fn = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32),
                                                          ir.IntType(32), ir.IntType(32)])
    for k in range(0, n + 1, 64):
        builder.call(fn, [builder.gep(wp, [builder.add(o, ir.Constant(ir.IntType(64), k))]),
                          ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 2),
                          ir.Constant(ir.IntType(32), 1)])


def _prefetch_row(builder, wp, o, block):
    """In a one-row kernel at the super-block at byte o (of `block` bytes): the one ROW_AHEAD on."""
    if ROW_AHEAD:
        _prefetch(builder, wp, builder.add(o, ir.Constant(ir.IntType(64), ROW_AHEAD)), block - 1)

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_V8F = ir.VectorType(_F32, 8)
_F32x4 = ir.VectorType(_F32, 4)


def const(v):
    """An i64 constant (offsets and sizes in the IR below)."""
    return ir.Constant(_I64, v)


def _ptr(context, builder, arytype, ary):
    return context.make_array(arytype)(context, builder, ary).data


def _load_vec(builder, base, offset, vec_type):
    ptr = builder.bitcast(builder.gep(base, [offset]), vec_type.as_pointer())
    return builder.load(ptr, align=1)


def _load_half(builder, base, offset):
    ptr = builder.bitcast(builder.gep(base, [offset]), ir.IntType(16).as_pointer())
    return builder.fpext(builder.bitcast(builder.load(ptr, align=1), ir.HalfType()), _F32)


def _fma(builder, a, b, c):
    t = a.type
    name = "llvm.fma.f32" if t == _F32 else f"llvm.fma.v{t.count}f32"
    return builder.call(_fn(builder, name, t, [t, t, t]), [a, b, c])


def _dpbusd(builder, acc, u8, s8):
    """<n x i32>: acc + lane j's four products u8[4j+k] * s8[4j+k] of <4n x i8> u8 / s8 (n = 8 or
    16): one vpdpbusd where the CPU has it at that width (VNNI / ZMM_VNNI), else the same integers
    from portable IR."""
    n = acc.type.count
    vi = _i32(n)
    if (n == 16 and ZMM_VNNI) or (n == 8 and VNNI):
        # the multiplicands as <n x i32>: LLVM before 21 declares them so, later ones upgrade the call
        fn = _fn(builder, f"llvm.x86.avx512.vpdpbusd.{32 * n}", vi, [vi] * 3)
        return builder.call(fn, [acc, builder.bitcast(u8, vi), builder.bitcast(s8, vi)])
    prod = builder.mul(builder.zext(u8, _i32(4 * n)), builder.sext(s8, _i32(4 * n)))
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(_i32(n), [4 * j + k for j in range(n)]))
             for k in range(4)]
    return builder.add(acc, builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3])))


def _quad_sums(builder, u8, s8):
    """<8 x i32>: lane j = sum_{k<4} u8[4j+k] * s8[4j+k] (u8 unsigned, s8 signed; pair sums fit
    int16, as pmaddubsw requires). The same integers from one vpdpbusd where the CPU has it."""
    if AVX2 and not VNNI:
        pairs = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _i16(16), [_i8(32), _i8(32)]), [u8, s8])
        ones = ir.Constant(_i16(16), [1] * 16)
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _i32(8), [_i16(16), _i16(16)]), [pairs, ones])
    return _dpbusd(builder, ir.Constant(_i32(8), [0] * 8), u8, s8)  # vpdpbusd, or portable IR


def _nibbles(builder, base, offset):
    """<32 x i8>: the 16 bytes at offset, low nibbles (weights 0..15) then high (16..31)."""
    raw = _load_vec(builder, base, offset, _i8(16))
    both = builder.shuffle_vector(raw, builder.lshr(raw, ir.Constant(_i8(16), [4] * 16)),
                                  ir.Constant(_i32(32), list(range(32))))
    return builder.and_(both, ir.Constant(_i8(32), [15] * 32))


def _hsum8(builder, acc):
    """ggml's hsum_float_8: ((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3))."""
    def lane(v, i):
        return builder.extract_element(v, ir.Constant(ir.IntType(32), i))

    r = [builder.fadd(lane(acc, i + 4), lane(acc, i)) for i in range(4)]
    return builder.fadd(builder.fadd(r[0], r[2]), builder.fadd(r[1], r[3]))


def _block_loop(context, builder, nb, body):
    """acc (<8 x float>) and a scalar sum over nb blocks; body(i, acc, s) -> (acc, s)."""
    acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8))
    s_ptr = cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0))
    with cgutils.for_range(builder, nb) as loop:
        acc, s = body(loop.index, builder.load(acc_ptr), builder.load(s_ptr))
        builder.store(acc, acc_ptr)
        builder.store(s, s_ptr)
    return builder.load(acc_ptr), builder.load(s_ptr)




@intrinsic
def rowdot_q4_1(typingctx, w, w_off, xq, x_off, xd, xm, b_off, nb):
    """float32: a Q4_1 row (20-byte blocks: d, m, qs[16]) times x in Q8_1 form, in ggml's order."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xm, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xm_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)
        mp = _ptr(context, builder, signature.args[5], xm_)

        def body(i, acc, summs):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(_I64, 20)))
            bi = builder.add(b_off_, i)
            d0 = _load_half(builder, wp, o)
            m0 = _load_half(builder, wp, builder.add(o, ir.Constant(_I64, 2)))
            d1 = builder.load(builder.gep(dp, [bi]))
            s1 = builder.load(builder.gep(mp, [bi]))
            summs = _fma(builder, m0, s1, summs)
            qx = _nibbles(builder, wp, builder.add(o, ir.Constant(_I64, 4)))
            qy = _load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(_I64, 32))), _i8(32))
            xy = builder.sitofp(_quad_sums(builder, qx, qy), _V8F)
            acc = _fma(builder, _splat(builder, builder.fmul(d0, d1), _V8F), xy, acc)
            return acc, summs

        acc, summs = _block_loop(context, builder, nb_, body)
        return builder.fadd(_hsum8(builder, acc), summs)

    return sig, codegen


@intrinsic
def rowdot_q8_0(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q8_0 row (34-byte blocks: d, qs[32] int8) times x in Q8_0 form, in ggml's order."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(_I64, 34)))
            d0 = _load_half(builder, wp, o)
            d1 = builder.load(builder.gep(dp, [builder.add(b_off_, i)]))
            qx = _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 2)), _i8(32))
            qy = _load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(_I64, 32))), _i8(32))
            ax, sy = _abs_sign(builder, qx, qy)
            xy = builder.sitofp(_quad_sums(builder, ax, sy), _V8F)
            acc = _fma(builder, _splat(builder, builder.fmul(d0, d1), _V8F), xy, acc)
            return acc, s

        acc, _ = _block_loop(context, builder, nb_, body)
        return _hsum8(builder, acc)

    return sig, codegen


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
            kp = _ptr(context, builder, signature.args[0], k_)
            if half:
                kp = builder.bitcast(kp, ir.IntType(16).as_pointer())
            qp = _ptr(context, builder, signature.args[2], q_)
            zero = ir.Constant(_V8F, [0.0] * 8)
            accs = [cgutils.alloca_once_value(builder, zero) for _ in range(groups)]
            steps = builder.udiv(n_, ir.Constant(_I64, 8 * groups))
            with cgutils.for_range(builder, steps) as loop:
                o = builder.mul(loop.index, ir.Constant(_I64, 8 * groups))
                for a in range(groups):
                    oa = builder.add(o, ir.Constant(_I64, 8 * a))
                    if half:
                        kv = _load_vec(builder, kp, builder.add(k_off_, oa), ir.VectorType(ir.IntType(16), 8))
                        if bf16:
                            wide = builder.shl(builder.zext(kv, _i32(8)), ir.Constant(_i32(8), [16] * 8))
                            kf = builder.bitcast(wide, _V8F)
                        else:
                            kf = builder.fpext(builder.bitcast(kv, ir.VectorType(ir.HalfType(), 8)), _V8F)
                    else:
                        kf = _load_vec(builder, kp, builder.add(k_off_, oa), _V8F)
                    qv = _load_vec(builder, qp, builder.add(q_off_, oa), _V8F)
                    builder.store(_fma(builder, kf, qv, builder.load(accs[a])), accs[a])
            vals = [builder.load(a) for a in accs]
            if groups == 1:
                return _hsum8(builder, vals[0])
            s = builder.fadd(builder.fadd(vals[0], vals[2]), builder.fadd(vals[1], vals[3]))
            if bf16:
                return _hsum8(builder, s)

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


def _bits_spread(builder, qh32):
    """<32 x i1>: bit j of the uint32 qh in lane j."""
    qh_bytes = builder.bitcast(qh32, _i8(4))
    spread = builder.shuffle_vector(qh_bytes, ir.Constant(_i8(4), ir.Undefined),
                                    ir.Constant(_i32(32), [j // 8 for j in range(32)]))
    bit = builder.and_(spread, ir.Constant(_i8(32), [1 << (j % 8) for j in range(32)]))
    return builder.icmp_unsigned("!=", bit, ir.Constant(_i8(32), [0] * 32))


@intrinsic
def rowdot_q5_0(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q5_0 row (22-byte blocks: d, qh u32, qs[16]) times x in Q8_0 form, in ggml's
    order (the weights as signed q - 16, then as Q8_0)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, ir.Constant(_I64, 22)))
            d0 = _load_half(builder, wp, o)
            d1 = builder.load(builder.gep(dp, [builder.add(b_off_, i)]))
            qh = _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 2)), ir.IntType(32))
            nib = _nibbles(builder, wp, builder.add(o, ir.Constant(_I64, 6)))
            # 5th bit clear: q - 16 = nibble - 16, i.e. the nibble with the high bits 0xF0 set
            high = builder.select(_bits_spread(builder, qh), ir.Constant(_i8(32), [0] * 32),
                                  ir.Constant(_i8(32), [0xF0] * 32))
            qx = builder.or_(nib, high)
            qy = _load_vec(builder, xp, builder.add(x_off_, builder.mul(i, ir.Constant(_I64, 32))), _i8(32))
            ax, sy = _abs_sign(builder, qx, qy)
            xy = builder.sitofp(_quad_sums(builder, ax, sy), _V8F)
            acc = _fma(builder, _splat(builder, builder.fmul(d0, d1), _V8F), xy, acc)
            return acc, s

        acc, _ = _block_loop(context, builder, nb_, body)
        return _hsum8(builder, acc)

    return sig, codegen


def _scaled_quads(builder, u8, s8, sc0, sc1):
    """<8 x i32>: lane j = sc(j) * sum_{k<4} u8[4j+k] * s8[4j+k], sc = sc0 for lanes 0..3
    (bytes 0..15), sc1 for 4..7; u8 in 0..63 (pair sums fit int16): pmaddubsw, then pmaddwd
    with the scales."""
    sc = builder.shuffle_vector(_splat(builder, builder.trunc(sc0, ir.IntType(16)), _i16(16)),
                                _splat(builder, builder.trunc(sc1, ir.IntType(16)), _i16(16)),
                                ir.Constant(_i32(16), list(range(8)) + list(range(24, 32))))
    return _pair_scaled(builder, u8, s8, sc)


def _pair_scaled(builder, u8, s8, sc):
    """<8 x i32>: lane j = sc[2j] * (u8[4j] s8[4j] + u8[4j+1] s8[4j+1]) + sc[2j+1] * (the next
    pair); sc <16 x i16>, one scale per pair of bytes; u8 in 0..63 (pair sums fit int16)."""
    if AVX2:
        p16 = builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _i16(16), [_i8(32), _i8(32)]), [u8, s8])
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _i32(8), [_i16(16), _i16(16)]), [p16, sc])
    prod = builder.mul(builder.zext(u8, _i32(32)), builder.sext(s8, _i32(32)))
    pairs = builder.add(builder.shuffle_vector(prod, prod, ir.Constant(_i32(16), list(range(0, 32, 2)))),
                        builder.shuffle_vector(prod, prod, ir.Constant(_i32(16), list(range(1, 32, 2)))))
    pairs = builder.mul(pairs, builder.sext(sc, _i32(16)))
    return builder.add(builder.shuffle_vector(pairs, pairs, ir.Constant(_i32(8), list(range(0, 16, 2)))),
                       builder.shuffle_vector(pairs, pairs, ir.Constant(_i32(8), list(range(1, 16, 2)))))


def _q6_k_codes(builder, wp, o, sc16):
    """The Q6_K super-block at byte o as eight steps of 32 weights: (step, the unsigned 6-bit codes
    <32 x i8> (low 4 bits from ql, high 2 from qh), their scales as pmaddwd pairs from sc16)."""
    for h in range(2):
        qh = _load_vec(builder, wp, builder.add(o, const(128 + 32 * h)), _i8(32))
        ql = [_load_vec(builder, wp, builder.add(o, const(64 * h + 32 * k)), _i8(32)) for k in (0, 1)]
        for t in range(4):
            lo = ql[t % 2] if t < 2 else builder.lshr(ql[t % 2], ir.Constant(_i8(32), [4] * 32))
            lo = builder.and_(lo, ir.Constant(_i8(32), [15] * 32))
            hi = builder.and_(builder.shl(qh, ir.Constant(_i8(32), [4 - 2 * t] * 32)) if t < 2 else
                              builder.lshr(qh, ir.Constant(_i8(32), [2 * t - 4] * 32)),
                              ir.Constant(_i8(32), [48] * 32))
            g = 8 * h + 2 * t
            yield 4 * h + t, builder.or_(lo, hi), builder.shuffle_vector(
                sc16, sc16, ir.Constant(_i32(16), [g] * 8 + [g + 1] * 8))


@intrinsic
def rowdot_q6_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q6_K row (210-byte super-blocks: ql[128], qh[64], scales i8[16], d) times x in
    Q8_K form (xs: sums per 16), in ggml's order: per super-block eight int32 lanes (lane j: the
    unsigned 6-bit q times x of weights 4j..4j+3 of every 32, scaled), minus lane j's share of the
    offset 32 * (sc[2j] xs[2j] + sc[2j+1] xs[2j+1]); then acc = fma(d_x * d_w, lanes, acc) and
    hsum_float_8."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)
        sp = _ptr(context, builder, signature.args[5], xs_)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(210)))
            _prefetch_row(builder, wp, o, 210)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            # the 16 scales once as <16 x i16>; each 32-weight group's pair of them by a shuffle
            sc16 = builder.sext(_load_vec(builder, wp, builder.add(o, const(192)), _i8(16)), _i16(16))
            sumi = ir.Constant(_i32(8), [0] * 8)
            for step, q, sc in _q6_k_codes(builder, wp, o, sc16):
                y = _load_vec(builder, xp, builder.add(xo, const(32 * step)), _i8(32))
                sumi = builder.add(sumi, _pair_scaled(builder, q, y, sc))
            # the -32 of every weight, per lane: 32 * (sc[2l] * xs[2l] + sc[2l+1] * xs[2l+1])
            # (xs: sums of 16 int8 values, |xs| <= 2048, exact in int16)
            s16 = builder.mul(builder.add(b_off_, i), const(16))
            xs16 = builder.trunc(_load_vec(builder, sp, s16, _i32(16)), _i16(16))
            offs = builder.shl(_madd16(builder, sc16, xs16), ir.Constant(_i32(8), [5] * 8))
            sumi = builder.sub(sumi, offs)
            d = builder.fmul(builder.load(builder.gep(dp, [builder.add(b_off_, i)])),
                             _load_half(builder, wp, builder.add(o, const(208))))
            acc = _fma(builder, _splat(builder, d, _V8F), builder.sitofp(sumi, _V8F), acc)
            return acc, s

        acc, _ = _block_loop(context, builder, nb_, body)
        return _hsum8(builder, acc)

    return sig, codegen


def _rowdotn_q6_k(n_tok: int):
    """rowdot_q6_k for n_tok tokens at once: rowdotn(w, w_off, xq, x_off, xd, xs, b_off, nb, out,
    out_off, out_stride), token t's Q8_K blocks at b_off + t nb (its values at x_off + 256 t nb),
    its result at out[out_off + t out_stride]. Each token's steps are rowdot_q6_k's, so each result
    is rowdot_q6_k's bit for bit; the row's codes are unpacked once for all of them."""
    u64 = types.uint64

    @intrinsic
    def rowdotn_q6_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb, out, out_off, out_stride):
        sig = types.void(w, u64, xq, u64, xd, xs, u64, u64, out, u64, u64)

        def codegen(context, builder, signature, args):
            w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_, out_, out_off_, out_stride_ = args
            wp = _ptr(context, builder, signature.args[0], w_)
            xp = _ptr(context, builder, signature.args[2], xq_)
            dp = _ptr(context, builder, signature.args[4], xd_)
            sp = _ptr(context, builder, signature.args[5], xs_)
            op = _ptr(context, builder, signature.args[8], out_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(n_tok)]
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                o = builder.add(w_off_, builder.mul(i, const(210)))
                _prefetch_row(builder, wp, o, 210)
                sc16 = builder.sext(_load_vec(builder, wp, builder.add(o, const(192)), _i8(16)), _i16(16))
                dw = _load_half(builder, wp, builder.add(o, const(208)))
                sumi = [ir.Constant(_i32(8), [0] * 8)] * n_tok
                for step, q, sc in _q6_k_codes(builder, wp, o, sc16):
                    for k in range(n_tok):
                        xo = builder.add(x_off_, builder.mul(builder.add(builder.mul(const(k), nb_), i), const(256)))
                        y = _load_vec(builder, xp, builder.add(xo, const(32 * step)), _i8(32))
                        sumi[k] = builder.add(sumi[k], _pair_scaled(builder, q, y, sc))
                for k in range(n_tok):
                    bi = builder.add(b_off_, builder.add(builder.mul(const(k), nb_), i))
                    xs16 = builder.trunc(_load_vec(builder, sp, builder.mul(bi, const(16)), _i32(16)), _i16(16))
                    offs = builder.shl(_madd16(builder, sc16, xs16), ir.Constant(_i32(8), [5] * 8))
                    d = builder.fmul(builder.load(builder.gep(dp, [bi])), dw)
                    acc = _fma(builder, _splat(builder, d, _V8F), builder.sitofp(builder.sub(sumi[k], offs), _V8F),
                               builder.load(accs[k]))
                    builder.store(acc, accs[k])
            for k in range(n_tok):
                at = builder.add(out_off_, builder.mul(const(k), out_stride_))
                builder.store(_hsum8(builder, builder.load(accs[k])), builder.gep(op, [at]))
            return context.get_dummy_value()

        return sig, codegen

    return rowdotn_q6_k


# one-token-order Q6_K rows for two and four tokens (a verification step's rows)
rowdotx2_q6_k, rowdotx4_q6_k = _rowdotn_q6_k(2), _rowdotn_q6_k(4)


def sbdot_tile(n_tok, with_min):
    """Exact integer sums of K-quant super-blocks unpacked to unsigned codes, for n_tok tokens:

        sbdot(wq, w_off, sc, s_off, cm, c_off, xq, x_off, x_stride, xs, xs_off, xs_stride)
        s1[t] = sum_{i<256} sc[s_off + i // 2] * wq[w_off + i] * xq[x_off + t x_stride + i]
                + sum_{g<16} cm[c_off + g] * xs[xs_off + t xs_stride + g]
        s2[t] = sum_{g<16} cm[c_off + 16 + g] * xs[...]       (with_min only)

    wq uint8 codes in 0..63, sc int16 (one scale per pair of weights), cm int16 (per group of
    16: the correction for the codes' offset, then the min), xq int8, xs int32 (x's sums per 16,
    |xs| < 2^15). Returns (s1[0], .., s1[n-1], then s2[..] with mins); codes, scales and
    corrections are loaded once for the n_tok tokens."""
    n_ret = n_tok * (2 if with_min else 1)

    @intrinsic
    def sbdot(typingctx, wq, w_off, sc, s_off, cm, c_off, xq, x_off, x_stride, xs, xs_off, xs_stride):
        ret = types.UniTuple(types.int32, n_ret) if n_ret > 1 else types.int32
        u64 = types.uint64
        sig = ret(wq, u64, sc, u64, cm, u64, xq, u64, u64, xs, u64, u64)

        def codegen(context, builder, signature, args):
            (wq_, w_off_, sc_, s_off_, cm_, c_off_, xq_, x_off_, x_stride_, xs_, xs_off_, xs_stride_) = args
            wp = _ptr(context, builder, signature.args[0], wq_)
            sp = _ptr(context, builder, signature.args[2], sc_)
            cp = _ptr(context, builder, signature.args[4], cm_)
            xp = _ptr(context, builder, signature.args[6], xq_)
            gp = _ptr(context, builder, signature.args[9], xs_)
            reduce = _fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [_i32(8)])
            xo = [builder.add(x_off_, builder.mul(const(t), x_stride_)) for t in range(n_tok)]
            go = [builder.add(xs_off_, builder.mul(const(t), xs_stride_)) for t in range(n_tok)]
            xs16 = [builder.trunc(_load_vec(builder, gp, go[t], _i32(16)), _i16(16)) for t in range(n_tok)]
            corr = _load_vec(builder, cp, c_off_, _i16(16))
            sums = [_madd16(builder, corr, xs16[t]) for t in range(n_tok)]
            for c in range(8):
                w = _load_vec(builder, wp, builder.add(w_off_, const(32 * c)), _i8(32))
                s = _load_vec(builder, sp, builder.add(s_off_, const(16 * c)), _i16(16))
                for t in range(n_tok):
                    y = _load_vec(builder, xp, builder.add(xo[t], const(32 * c)), _i8(32))
                    sums[t] = builder.add(sums[t], _pair_scaled(builder, w, y, s))
            results = [builder.call(reduce, [v]) for v in sums]
            if with_min:
                mins = _load_vec(builder, cp, builder.add(c_off_, const(16)), _i16(16))
                results += [builder.call(reduce, [_madd16(builder, mins, xs16[t])]) for t in range(n_tok)]
            return context.make_tuple(builder, ret, results) if n_ret > 1 else results[0]

        return sig, codegen

    return sbdot


def _pair_adds(builder, v):
    """<4 x i32>: v[2c] + v[2c + 1] of a <8 x i32>."""
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(_i32(4), [0, 2, 4, 6])),
                       builder.shuffle_vector(v, v, ir.Constant(_i32(4), [1, 3, 5, 7])))


def _reduce4(builder, vs):
    """<4 x i32>: the lane sums of four <8 x i32> (integers: any order is exact), in three rounds
    of shuffles and adds instead of four full reductions."""
    def fold(a, b, lo, hi):
        return builder.add(builder.shuffle_vector(a, b, ir.Constant(_i32(8), lo)),
                           builder.shuffle_vector(a, b, ir.Constant(_i32(8), hi)))

    a = fold(vs[0], vs[1], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
    b = fold(vs[2], vs[3], [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15])
    return _pair_adds(builder, fold(a, b, [0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]))


def _madd16(builder, a, b):
    """<8 x i32>: lane j = a[2j] b[2j] + a[2j+1] b[2j+1] of two <16 x i16> (pmaddwd)."""
    if AVX2:
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.wd", _i32(8), [_i16(16), _i16(16)]), [a, b])
    prod = builder.mul(builder.sext(a, _i32(16)), builder.sext(b, _i32(16)))
    return builder.add(builder.shuffle_vector(prod, prod, ir.Constant(_i32(8), list(range(0, 16, 2)))),
                       builder.shuffle_vector(prod, prod, ir.Constant(_i32(8), list(range(1, 16, 2)))))


sbdot1 = sbdot_tile(1, False)
sbdot4 = sbdot_tile(4, False)
sbdot1_min = sbdot_tile(1, True)
sbdot4_min = sbdot_tile(4, True)


# --- eight tokens at a time, the whole row: the tiled product's float steps as lanes -----------
def _reduce8(builder, vs):
    """<8 x i32>: lane t = the lane sum of vs[t], for eight <8 x i32> (integers: any order is
    exact): unpack-and-add rounds within the 128-bit halves, then the halves added."""
    def sh(a, b, mask):
        return builder.shuffle_vector(a, b, ir.Constant(_i32(8), mask))

    def four(a, b, c, d):  # [a b c d] sums of the low halves | of the high halves
        ab = builder.add(sh(a, b, [0, 8, 1, 9, 4, 12, 5, 13]), sh(a, b, [2, 10, 3, 11, 6, 14, 7, 15]))
        cd = builder.add(sh(c, d, [0, 8, 1, 9, 4, 12, 5, 13]), sh(c, d, [2, 10, 3, 11, 6, 14, 7, 15]))
        return builder.add(sh(ab, cd, [0, 1, 8, 9, 4, 5, 12, 13]), sh(ab, cd, [2, 3, 10, 11, 6, 7, 14, 15]))

    lo, hi = four(*vs[:4]), four(*vs[4:])
    return builder.add(sh(lo, hi, [0, 1, 2, 3, 8, 9, 10, 11]), sh(lo, hi, [4, 5, 6, 7, 12, 13, 14, 15]))


def _low_halves(builder, sc):
    """<32 x i16>: sc[2j] then 0 for each pair j of pair scales sc (one scale per four codes, as
    every K-quant's groups of 16 or 32 have): as int32 lanes, the scale sign-free in the low half."""
    lanes = builder.bitcast(sc, _i32(16))
    return builder.bitcast(builder.and_(lanes, ir.Constant(_i32(16), [0xFFFF] * 16)), _i16(32))


def _quads_scaled(builder, acc, u8, s8, sc):
    """<16 x i32>: acc + lane j's scale * sum_{k<4} u8[4j+k] s8[4j+k] of <64 x i8> u8 / s8, the
    scales from _low_halves (ZMM_VNNI only). The quad sums (|sum| <= 4 * 63 * 128 < 2^15) are
    one vpdpbusd; read as int16 pairs (the sum, its sign extension) they meet (scale, 0) in one
    vpdpwssd, so the scale costs no multiply of its own: two multiplies per 64 codes instead of
    the four of pmaddubsw + pmaddwd at 256 bits."""
    vi = _i32(16)
    quads = _dpbusd(builder, ir.Constant(vi, [0] * 16), u8, s8)
    fn = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", vi, [vi] * 3)
    return builder.call(fn, [ir.Constant(vi, [0] * 16) if acc is None else acc, quads, builder.bitcast(sc, vi)])


def _fold16(builder, v):
    """<8 x i32>: v[j] + v[j + 8] of a <16 x i32>."""
    return builder.add(builder.shuffle_vector(v, v, ir.Constant(_i32(8), list(range(8)))),
                       builder.shuffle_vector(v, v, ir.Constant(_i32(8), list(range(8, 16)))))


def _pair_splat(builder, base, offset):
    """<16 x i16>: the two int16 at base[offset], base[offset + 1] repeated eight times."""
    pair = _load_vec(builder, base, offset, _i16(2))
    return builder.shuffle_vector(pair, pair, ir.Constant(_i32(16), [0, 1] * 8))


def tile8_row(with_corr, with_min):
    """A row of a K-quant matrix unpacked as for sbdot_tile, times eight tokens, every
    super-block in llama.cpp's tiled float order (see kquants.matmul_tiled), the eight tokens as
    the lanes of one vector:

        tile8(wq, sc, cm, k0, dw, dm, xq, x_off, x_stride, xsT, xdT, g_off, nb) -> 8 x float32

    super-block j of the row is unpacked super-block k0 + j (wq[256 k..], sc[128 k..], cm[32 k..],
    dw[k], dm[k]); token t's x block j at xq[x_off + t x_stride + 256 j]; xsT (int16) the eight
    tokens' sums per 16, at g_off * 16 + 128 j + 16 p + 2 t + h = group 2p + h of token t; xdT
    (float32) the tokens' scales at g_off + 8 j + t. with_corr: s1 gains sum cm[g] xs[g] (the
    codes' offset); with_min: s2 = sum cm[16 + g] xs[g]."""
    @intrinsic
    def tile8(typingctx, wq, sc, cm, k0, dw, dm, xq, x_off, x_stride, xsT, xdT, g_off, nb):
        ret = types.UniTuple(types.float32, 8)
        u64 = types.uint64
        sig = ret(wq, sc, cm, u64, dw, dm, xq, u64, u64, xsT, xdT, u64, u64)

        def codegen(context, builder, signature, args):
            (wq_, sc_, cm_, k0_, dw_, dm_, xq_, x_off_, x_stride_, xsT_, xdT_, g_off_, nb_) = args
            a = signature.args
            wp, sp, cp = (_ptr(context, builder, a[i], v) for i, v in ((0, wq_), (1, sc_), (2, cm_)))
            dwp, dmp = _ptr(context, builder, a[4], dw_), _ptr(context, builder, a[5], dm_)
            xp, gp, dp = (_ptr(context, builder, a[i], v) for i, v in ((6, xq_), (9, xsT_), (10, xdT_)))
            xo = [builder.add(x_off_, builder.mul(const(t), x_stride_)) for t in range(8)]
            g16 = builder.mul(g_off_, const(16))
            acc_ptr = cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8))
            with cgutils.for_range(builder, nb_) as loop:
                j = loop.index
                k = builder.add(k0_, j)
                w0, s0, c0 = builder.mul(k, const(256)), builder.mul(k, const(128)), builder.mul(k, const(32))
                xj = builder.mul(j, const(256))
                sums = [None] * 8
                if ZMM_VNNI:
                    for c in range(4):
                        w = _load_vec(builder, wp, builder.add(w0, const(64 * c)), _i8(64))
                        s = _low_halves(builder, _load_vec(builder, sp, builder.add(s0, const(32 * c)), _i16(32)))
                        for t in range(8):
                            y = _load_vec(builder, xp, builder.add(builder.add(xo[t], xj), const(64 * c)), _i8(64))
                            sums[t] = _quads_scaled(builder, sums[t], w, y, s)
                    sums = [_fold16(builder, v) for v in sums]
                else:
                    for c in range(8):
                        w = _load_vec(builder, wp, builder.add(w0, const(32 * c)), _i8(32))
                        s = _load_vec(builder, sp, builder.add(s0, const(16 * c)), _i16(16))
                        for t in range(8):
                            y = _load_vec(builder, xp, builder.add(builder.add(xo[t], xj), const(32 * c)), _i8(32))
                            p = _pair_scaled(builder, w, y, s)
                            sums[t] = p if sums[t] is None else builder.add(sums[t], p)
                s1 = _reduce8(builder, sums)
                gj = builder.add(g16, builder.mul(j, const(128)))
                xs = [_load_vec(builder, gp, builder.add(gj, const(16 * p)), _i16(16)) for p in range(8)] \
                    if (with_corr or with_min) else None

                def groups(first):
                    v = None
                    for p in range(8):
                        m = _madd16(builder, xs[p], _pair_splat(builder, cp, builder.add(c0, const(first + 2 * p))))
                        v = m if v is None else builder.add(v, m)
                    return v

                if with_corr:
                    s1 = builder.add(s1, groups(0))
                res = builder.fmul(_splat(builder, builder.load(builder.gep(dwp, [k])), _V8F), builder.sitofp(s1, _V8F))
                if with_min:
                    s2 = builder.sitofp(groups(16), _V8F)
                    dm = builder.fneg(builder.load(builder.gep(dmp, [k])))
                    res = _fma(builder, _splat(builder, dm, _V8F), s2, res)
                xd = _load_vec(builder, dp, builder.add(g_off_, builder.mul(j, const(8))), _V8F)
                builder.store(_fma(builder, res, xd, builder.load(acc_ptr)), acc_ptr)
            acc = builder.load(acc_ptr)
            vals = [builder.extract_element(acc, ir.Constant(ir.IntType(32), t)) for t in range(8)]
            return context.make_tuple(builder, ret, vals)

        return sig, codegen

    return tile8


tile8_corr = tile8_row(True, False)
tile8_min = tile8_row(False, True)


# --- four tokens at a time ---------------------------------------------------------------------
# The prompt products: a row's blocks are unpacked once and multiplied with four tokens' blocks,
# each token keeping its own accumulators, so every (row, token) result is the one-token row dot
# product above, bit for bit, at a fraction of the unpacking.
TILE = 4
# "q4_1u": a Q4_1 block unpacked for the prompt products (legacy.unpack_q4_1_rows): d and m as
# float32, then the 32 codes one per byte, so the tiles passing over it skip the f16 conversions
# and the nibble split
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34, "q5_0": 22, "q5_1": 24, "q4_1u": 40}


def _legacy_weights(builder, wp, o, kind):
    """(d, m or None, weights <32 x i8>, signed?) of the legacy block at byte o: unsigned q for
    Q4_1 / Q5_1 (multiplied as u8 x s8), signed q for Q8_0 and Q5_0 (q - 16, as ggml builds it)."""
    if kind == "q4_1u":
        dm = _load_vec(builder, wp, o, _i8(8))
        pair = builder.bitcast(dm, ir.VectorType(_F32, 2))
        return (builder.extract_element(pair, ir.Constant(ir.IntType(32), 0)),
                builder.extract_element(pair, ir.Constant(ir.IntType(32), 1)),
                _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 8)), _i8(32)), False)
    d0 = _load_half(builder, wp, o)
    if kind == "q4_1":
        m0 = _load_half(builder, wp, builder.add(o, ir.Constant(_I64, 2)))
        return d0, m0, _nibbles(builder, wp, builder.add(o, ir.Constant(_I64, 4))), False
    if kind == "q8_0":
        return d0, None, _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 2)), _i8(32)), True
    if kind == "q5_1":  # d, m, qh, qs: the 5th bit adds 16
        m0 = _load_half(builder, wp, builder.add(o, ir.Constant(_I64, 2)))
        qh = _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 4)), ir.IntType(32))
        nib = _nibbles(builder, wp, builder.add(o, ir.Constant(_I64, 8)))
        high = builder.select(_bits_spread(builder, qh), ir.Constant(_i8(32), [16] * 32), ir.Constant(_i8(32), [0] * 32))
        return d0, m0, builder.or_(nib, high), False
    qh = _load_vec(builder, wp, builder.add(o, ir.Constant(_I64, 2)), ir.IntType(32))
    nib = _nibbles(builder, wp, builder.add(o, ir.Constant(_I64, 6)))
    high = builder.select(_bits_spread(builder, qh), ir.Constant(_i8(32), [0] * 32), ir.Constant(_i8(32), [0xF0] * 32))
    return d0, None, builder.or_(nib, high), True


def _legacy_tile(kind, n_tok=TILE):
    """A legacy-type row dot product for n_tok tokens at once (a float32 for one token, else a
    tuple): xq block i of token t at x_off + t * x_stride + 32 i; its scale d_x (xd) and Q8_1 sum
    s_x (xm) at b_off + n_tok i + t, the tokens' values interleaved (interleave_blocks), so a
    block's d_w * d_x and fma(m_w, s_x, summs) are one n_tok-lane op each for all the tokens.
    Every lane does what the one-token code does: each result is rowdot_<kind>'s, bit for bit."""
    size = _BLOCK_BYTES[kind]
    lanes = ir.VectorType(_F32, n_tok)
    m0_used = kind in ("q4_1", "q4_1u", "q5_1")

    @intrinsic
    def rowdot_tile(typingctx, w, w_off, xq, x_off, x_stride, xd, xm, b_off, nb):
        ret = types.UniTuple(types.float32, n_tok) if n_tok > 1 else types.float32
        sig = ret(w, types.uint64, xq, types.uint64, types.uint64, xd, xm, types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            w_, w_off_, xq_, x_off_, x_stride_, xd_, xm_, b_off_, nb_ = args
            wp = _ptr(context, builder, signature.args[0], w_)
            xp = _ptr(context, builder, signature.args[2], xq_)
            dp = _ptr(context, builder, signature.args[5], xd_)
            mp = _ptr(context, builder, signature.args[6], xm_)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(n_tok)]
            sums = cgutils.alloca_once_value(builder, ir.Constant(lanes, [0.0] * n_tok))
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                o = builder.add(w_off_, builder.mul(i, const(size)))
                d0, m0, qx, signed = _legacy_weights(builder, wp, o, kind)
                ax = _abs_sign(builder, qx, qx)[0] if signed else qx
                bo = builder.add(b_off_, builder.mul(i, const(n_tok)))
                dd = builder.fmul(_splat(builder, d0, lanes), _load_vec(builder, dp, bo, lanes))
                if m0 is not None:
                    builder.store(_fma(builder, _splat(builder, m0, lanes), _load_vec(builder, mp, bo, lanes),
                                       builder.load(sums)), sums)
                for t in range(n_tok):
                    xo = builder.add(builder.add(x_off_, builder.mul(const(t), x_stride_)), builder.mul(i, const(32)))
                    qy = _load_vec(builder, xp, xo, _i8(32))
                    sy = _abs_sign(builder, qx, qy)[1] if signed else qy
                    xy = builder.sitofp(_quad_sums(builder, ax, sy), _V8F)
                    ddt = builder.shuffle_vector(dd, dd, ir.Constant(_i32(8), [t] * 8))
                    builder.store(_fma(builder, ddt, xy, builder.load(accs[t])), accs[t])
            sv = builder.load(sums)
            results = []
            for t in range(n_tok):
                r = _hsum8(builder, builder.load(accs[t]))
                if m0_used:
                    r = builder.fadd(r, builder.extract_element(sv, ir.Constant(ir.IntType(32), t)))
                results.append(r)
            return context.make_tuple(builder, ret, results) if n_tok > 1 else results[0]

        return sig, codegen

    return rowdot_tile


def _q8_0_two_rows(n_tok, per_vec):
    """Two Q8_0 rows times n_tok tokens (2 n_tok float32: row 0's tokens, then row 1's), each
    result rowdot_q8_0's bit for bit:

        tile(w, w_off0, w_off1, xg, x_off, corr, xd, b_off, nb) -> 2 n_tok x float32

    The weights go in as unsigned bytes w + 128 and each lane's integer sum starts from -128 x the
    token's four activations (corr, once per batch: legacy.q8_0_group_inputs), so the activations
    need no per-row sign fix (as vpdpbusd's u8 x s8 form otherwise takes) and both rows share every
    activation load: per row, token and block one vpdpbusd, one int-to-float, one multiply and one
    fma. per_vec tokens a vector: 2 (512-bit, ZMM_VNNI) or 1 (256-bit, VNNI). xg: per block the
    group's n_tok x 32 codes side by side, block i of the group at x_off + 32 n_tok i; corr: eight
    int32 a token and block, at 8 (b_off + n_tok i + t); xd: b_off + n_tok i + t."""
    lanes = 8 * per_vec
    vf, vi = ir.VectorType(_F32, lanes), _i32(lanes)
    n_vec = n_tok // per_vec
    dup = ir.Constant(_i32(32 * per_vec), list(range(32)) * per_vec)
    flip = ir.Constant(_i8(32), [-128] * 32)

    @intrinsic
    def tile(typingctx, w, w_off0, w_off1, xg, x_off, corr, xd, b_off, nb):
        u64 = types.uint64
        sig = types.UniTuple(types.float32, 2 * n_tok)(w, u64, u64, xg, u64, corr, xd, u64, u64)

        def codegen(context, builder, signature, args):
            w_, w_off0_, w_off1_, xg_, x_off_, corr_, xd_, b_off_, nb_ = args
            wp = _ptr(context, builder, signature.args[0], w_)
            xp = _ptr(context, builder, signature.args[3], xg_)
            cp = _ptr(context, builder, signature.args[5], corr_)
            dp = _ptr(context, builder, signature.args[6], xd_)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(n_vec)]
                    for _ in range(2)]
            with cgutils.for_range(builder, nb_) as loop:
                i = loop.index
                bo = builder.add(b_off_, builder.mul(i, const(n_tok)))
                xdn = _load_vec(builder, dp, bo, ir.VectorType(_F32, n_tok))
                wu, dd = [], []
                for off in (w_off0_, w_off1_):
                    o = builder.add(off, builder.mul(i, const(34)))
                    q = builder.xor(_load_vec(builder, wp, builder.add(o, const(2)), _i8(32)), flip)
                    wu.append(builder.shuffle_vector(q, q, dup) if per_vec > 1 else q)
                    d0 = _splat(builder, _load_half(builder, wp, o), ir.VectorType(_F32, n_tok))
                    dd.append(builder.fmul(d0, xdn))
                xo = builder.add(x_off_, builder.mul(i, const(32 * n_tok)))
                for v in range(n_vec):
                    xv = _load_vec(builder, xp, builder.add(xo, const(32 * per_vec * v)), _i8(32 * per_vec))
                    cv = _load_vec(builder, cp, builder.add(builder.mul(bo, const(8)), const(lanes * v)), vi)
                    sel = ir.Constant(_i32(lanes), [per_vec * v + h for h in range(per_vec) for _ in range(8)])
                    for r in range(2):
                        xy = builder.sitofp(_dpbusd(builder, cv, wu[r], xv), vf)
                        ddv = builder.shuffle_vector(dd[r], dd[r], sel)
                        builder.store(_fma(builder, ddv, xy, builder.load(accs[r][v])), accs[r][v])
            results = []
            for r in range(2):
                for v in range(n_vec):
                    acc = builder.load(accs[r][v])
                    for h in range(per_vec):
                        part = builder.shuffle_vector(acc, acc, ir.Constant(_i32(8), list(range(8 * h, 8 * h + 8))))
                        results.append(_hsum8(builder, part))
            return context.make_tuple(builder, signature.return_type, results)

        return sig, codegen

    return tile


# Q8_0 batches: two rows x eight tokens in 512-bit vectors with AVX-512 VNNI, two rows x four in
# 256-bit ones with VNNI alone (AVX-VNNI); without VNNI the sign-fix tiles of _legacy_tile
Q8_0_GROUP = 8 if ZMM_VNNI else 4 if VNNI else 0
rowdot2xn_q8_0 = _q8_0_two_rows(8, 2) if ZMM_VNNI else _q8_0_two_rows(4, 1)


rowdot4_q4_1u = _legacy_tile("q4_1u")
rowdot4_q8_0 = _legacy_tile("q8_0")
rowdot4_q5_1 = _legacy_tile("q5_1")
rowdot8_q5_0 = _legacy_tile("q5_0", 8)
rowdot1_q5_1 = _legacy_tile("q5_1", 1)  # one token (x_stride unused)


def _k_scale_min(builder, wp, o, b):
    """(scale, min) as int32 of sub-block b (0..7) of a Q4_K / Q5_K super-block whose 12 packed
    6-bit scale bytes start at byte o."""
    def byte(k):
        return builder.zext(builder.load(builder.gep(wp, [builder.add(o, ir.Constant(_I64, k))])), ir.IntType(32))

    def c(v):
        return ir.Constant(ir.IntType(32), v)

    if b < 4:
        return builder.and_(byte(b), c(63)), builder.and_(byte(b + 4), c(63))
    sc = builder.or_(builder.and_(byte(b + 4), c(15)), builder.shl(builder.lshr(byte(b - 4), c(6)), c(4)))
    mn = builder.or_(builder.lshr(byte(b + 4), c(4)), builder.shl(builder.lshr(byte(b), c(6)), c(4)))
    return sc, mn


def _k_scales(builder, wp, o):
    """<16 x i16>: the eight 6-bit scales then the eight mins of the Q4_K / Q5_K super-block at byte
    o, unpacked in one 128-bit vector: the 12 scale bytes as words u0 u1 u2 (and 4 bytes of the
    codes after them, unused), lanes [sc 0-3, sc 4-7, mn 0-3, mn 4-7] = [u0 & 3F, (u2 & 0F) |
    (u0 >> 2 & 30), u1 & 3F, (u2 >> 4 & 0F) | (u1 >> 2 & 30)] per byte (ggml's get_scale_min_k4)."""
    def c4(vals):
        return ir.Constant(_i32(4), vals)

    v = _load_vec(builder, wp, builder.add(o, const(4)), _i32(4))
    a = builder.shuffle_vector(v, v, c4([0, 2, 1, 2]))  # u0 u2 u1 u2
    b = builder.shuffle_vector(v, v, c4([0, 0, 1, 1]))  # u0 u0 u1 u1
    low = builder.and_(builder.lshr(a, c4([0, 0, 0, 4])), c4([0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]))
    high = builder.and_(builder.lshr(b, c4([2, 2, 2, 2])), c4([0, 0x30303030, 0, 0x30303030]))
    return builder.zext(builder.bitcast(builder.or_(low, high), _i8(16)), _i16(16))


@intrinsic
def rowdot_q5_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q5_K row (176-byte super-blocks: d, dmin, scales[12], qh[32], qs[128]) times x in
    Q8_K form, in ggml's x86 order: per super-block eight int32 lanes (lane j: weights 4j..4j+3 of
    every 32, times their sub-block's scale), acc = fma(d_x * d_w, lanes, acc); the mins apart,
    summs = fma(-d_x * dmin_w, sum of min * (x sums), summs); result hsum_float_8(acc) + summs."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)
        sp = _ptr(context, builder, signature.args[5], xs_)

        def body(i, acc, summs):
            o = builder.add(w_off_, builder.mul(i, const(176)))
            _prefetch_row(builder, wp, o, 176)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            bi = builder.add(b_off_, i)
            qh = _load_vec(builder, wp, builder.add(o, const(16)), _i8(32))
            sm = _k_scales(builder, wp, o)  # <16 x i16>: the eight scales, then the eight mins
            sumi = ir.Constant(_i32(8), [0] * 8)
            for c in range(4):
                qs = _load_vec(builder, wp, builder.add(o, const(48 + 32 * c)), _i8(32))
                for half in range(2):
                    b = 2 * c + half
                    lo = builder.and_(qs if half == 0 else builder.lshr(qs, ir.Constant(_i8(32), [4] * 32)),
                                      ir.Constant(_i8(32), [15] * 32))
                    hi = (builder.shl(qh, ir.Constant(_i8(32), [4 - b] * 32)) if b < 4 else
                          builder.lshr(qh, ir.Constant(_i8(32), [b - 4] * 32)))
                    q = builder.or_(lo, builder.and_(hi, ir.Constant(_i8(32), [16] * 32)))
                    y = _load_vec(builder, xp, builder.add(xo, const(32 * b)), _i8(32))
                    sc = builder.shuffle_vector(sm, sm, ir.Constant(_i32(16), [b] * 16))
                    sumi = builder.add(sumi, _pair_scaled(builder, q, y, sc))
            # the mins: sum_b m_b (xs[2b] + xs[2b+1]) (xs: sums of 16 int8 values, exact in int16)
            xs16 = builder.trunc(_load_vec(builder, sp, builder.mul(bi, const(16)), _i32(16)), _i16(16))
            mins = builder.shuffle_vector(sm, sm, ir.Constant(_i32(16), [8 + k // 2 for k in range(16)]))
            mv = _madd16(builder, mins, xs16)
            msum = builder.call(_fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [_i32(8)]), [mv])
            dx = builder.load(builder.gep(dp, [bi]))
            d = builder.fmul(dx, _load_half(builder, wp, o))
            dmin = builder.fmul(builder.fneg(dx), _load_half(builder, wp, builder.add(o, const(2))))
            acc = _fma(builder, _splat(builder, d, _V8F), builder.sitofp(sumi, _V8F), acc)
            summs = _fma(builder, dmin, builder.sitofp(msum, _F32), summs)
            return acc, summs

        acc, summs = _block_loop(context, builder, nb_, body)
        return builder.fadd(_hsum8(builder, acc), summs)

    return sig, codegen


def _load_v8f(builder, base, offset, half):
    """8 floats at element offset of a float32 array, or of float16 bits (uint16), widened."""
    if not half:
        return _load_vec(builder, base, offset, _V8F)
    raw = _load_vec(builder, base, offset, ir.VectorType(ir.IntType(16), 8))
    return builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8)), _V8F)


def _dot4_heads(n_q):
    """Scores in tinyBLAS's order (an 8-lane accumulator per score, fma in element order, then
    hsum_float_8) of four keys k[k_off + r * k_stride ...] (r < 4; float32, or float16 bits as
    uint16) with n_q queries q[q_off + i * q_stride ...] (float32; heads sharing a KV head) into
    s[s_off + i * s_stride + r], n a multiple of 8; a key's block is loaded (and converted
    from f16) once for all n_q queries, and the 4 n_q chains hide the fma latency."""

    @intrinsic
    def dot4_heads(typingctx, k, k_off, k_stride, q, q_off, q_stride, n, s, s_off, s_stride):
        half = k.dtype == types.uint16
        sig = types.void(k, types.uint64, types.uint64, q, types.uint64, types.uint64, types.uint64, s,
                         types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            k_, k_off_, k_stride_, q_, q_off_, q_stride_, n_, s_, s_off_, s_stride_ = args
            kp = _ptr(context, builder, signature.args[0], k_)
            qp = _ptr(context, builder, signature.args[3], q_)
            sp = _ptr(context, builder, signature.args[7], s_)
            koffs = [builder.add(k_off_, builder.mul(const(r), k_stride_)) for r in range(4)]
            qoffs = [builder.add(q_off_, builder.mul(const(i), q_stride_)) for i in range(n_q)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(4)]
                    for _ in range(n_q)]
            with cgutils.for_range(builder, builder.udiv(n_, const(8))) as loop:
                o = builder.mul(loop.index, const(8))
                qvs = [_load_vec(builder, qp, builder.add(qo, o), _V8F) for qo in qoffs]
                for r in range(4):
                    kv = _load_v8f(builder, kp, builder.add(koffs[r], o), half)
                    for i in range(n_q):
                        builder.store(_fma(builder, kv, qvs[i], builder.load(accs[i][r])), accs[i][r])
            for i in range(n_q):
                row = builder.add(s_off_, builder.mul(const(i), s_stride_))
                for r in range(4):
                    builder.store(_hsum8(builder, builder.load(accs[i][r])),
                                  builder.gep(sp, [builder.add(row, const(r))]))
            return context.get_dummy_value()

        return sig, codegen

    return dot4_heads


dot4_heads1, dot4_heads2, dot4_heads3 = (_dot4_heads(n) for n in (1, 2, 3))


def _scores_heads(n_q):
    """Decode attention's scores of n_q heads sharing a KV head, all of a token's keys in one
    loop: for j < used, key row k[kmap[k0 + j] row_stride + k_off ...] (float32 or float16 bits,
    n elements, a multiple of 32) with queries q[q_off + i q_stride ...]:
    s[s_off + i s_stride + j] = dot_f16(key, query i, n_acc 4) * scale (dot_f16's bits), with
    the key loaded and converted once for the n_q heads."""

    @intrinsic
    def scores_heads(typingctx, k, kmap, k0, used, k_off, row_stride, q, q_off, q_stride, n, s, s_off,
                     s_stride, scale):
        half = k.dtype == types.uint16
        sig = types.void(k, kmap, types.uint64, types.uint64, types.uint64, types.uint64, q, types.uint64,
                         types.uint64, types.uint64, s, types.uint64, types.uint64, types.float32)

        def codegen(context, builder, signature, args):
            (k_, kmap_, k0_, used_, k_off_, row_stride_, q_, q_off_, q_stride_, n_, s_, s_off_, s_stride_,
             scale_) = args
            kp = _ptr(context, builder, signature.args[0], k_)
            mp = _ptr(context, builder, signature.args[1], kmap_)
            qp = _ptr(context, builder, signature.args[6], q_)
            sp = _ptr(context, builder, signature.args[10], s_)
            qoffs = [builder.add(q_off_, builder.mul(const(i), q_stride_)) for i in range(n_q)]
            soffs = [builder.add(s_off_, builder.mul(const(i), s_stride_)) for i in range(n_q)]
            zero = ir.Constant(_V8F, [0.0] * 8)
            with cgutils.for_range(builder, used_) as keys:
                j = keys.index
                slot = builder.load(builder.gep(mp, [builder.add(k0_, j)]))
                base = builder.add(builder.mul(slot, row_stride_), k_off_)
                accs = [[cgutils.alloca_once(builder, _V8F) for _ in range(4)] for _ in range(n_q)]
                for row in accs:
                    for a in row:
                        builder.store(zero, a)
                with cgutils.for_range(builder, builder.udiv(n_, const(32))) as loop:
                    o = builder.mul(loop.index, const(32))
                    for a in range(4):
                        oa = builder.add(o, const(8 * a))
                        kv = _load_v8f(builder, kp, builder.add(base, oa), half)
                        for i in range(n_q):
                            qv = _load_vec(builder, qp, builder.add(qoffs[i], oa), _V8F)
                            builder.store(_fma(builder, kv, qv, builder.load(accs[i][a])), accs[i][a])
                for i in range(n_q):
                    vals = [builder.load(a) for a in accs[i]]
                    v = builder.fadd(builder.fadd(vals[0], vals[2]), builder.fadd(vals[1], vals[3]))
                    lane = [builder.extract_element(v, ir.Constant(ir.IntType(32), e)) for e in range(8)]
                    t = [builder.fadd(lane[e], lane[e + 4]) for e in range(4)]
                    d = builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))
                    builder.store(builder.fmul(d, scale_), builder.gep(sp, [builder.add(soffs[i], j)]))
            return context.get_dummy_value()

        return sig, codegen

    return scores_heads


scores_heads1, scores_heads2, scores_heads3, scores_heads4 = (_scores_heads(n) for n in (1, 2, 3, 4))


def _pv_lanes(n_q):
    """Decode attention's value sums of n_q heads sharing a KV head, in vec_dot_f16's 32 lanes: key j
    goes to lane j % 32, so for each head i with e[p_off + i p_stride + j] != 0 (a key a head gives
    probability 0 adds nothing: it is skipped) acc[acc_off + i acc_stride + (j % 32) n + d] =
    fma(v[d], p[that], itself), in key order within each lane (axpy_f16's fma, so its bits); the
    value row of key j is v[kmap[k0 + j] row_stride + v_off ...] (float32 or float16 bits, n
    elements, a multiple of 8). The loops run a lane at a time (keys l, l + 32, l + 64, ...), so for
    each lane and stretch of values the n_q heads' accumulators stay in registers over all its keys,
    loaded and stored once (not every head's accumulator row at each key). A stretch is 32 values per head where that fits in the registers,
    then eight at a time for the rest of the row."""
    k_main = max(1, min(4, (16 if REGS32 else 8) // n_q))

    @intrinsic
    def pv_lanes(typingctx, v, kmap, k0, used, v_off, row_stride, e, p, p_off, p_stride, acc, acc_off,
                 acc_stride, n):
        half = v.dtype == types.uint16
        sig = types.void(v, kmap, types.uint64, types.uint64, types.uint64, types.uint64, e, p, types.uint64,
                         types.uint64, acc, types.uint64, types.uint64, types.uint64)

        def codegen(context, builder, signature, args):
            (v_, kmap_, k0_, used_, v_off_, row_stride_, e_, p_, p_off_, p_stride_, acc_, acc_off_, acc_stride_,
             n_) = args
            vp = _ptr(context, builder, signature.args[0], v_)
            mp = _ptr(context, builder, signature.args[1], kmap_)
            ep = _ptr(context, builder, signature.args[6], e_)
            pp = _ptr(context, builder, signature.args[7], p_)
            ap = _ptr(context, builder, signature.args[10], acc_)
            poffs = [builder.add(p_off_, builder.mul(const(i), p_stride_)) for i in range(n_q)]
            zero = ir.Constant(_F32, 0.0)
            n_main = builder.mul(builder.udiv(n_, const(8 * k_main)), const(8 * k_main))

            def stretch(lane, d0, k):
                """Lane `lane`'s accumulators of values d0 .. d0 + 8k of every head over its keys."""
                rows = [builder.add(builder.add(acc_off_, builder.mul(const(i), acc_stride_)),
                                    builder.add(builder.mul(lane, n_), d0)) for i in range(n_q)]
                ptrs = [[builder.bitcast(builder.gep(ap, [builder.add(rows[i], const(8 * c))]), _V8F.as_pointer())
                         for c in range(k)] for i in range(n_q)]
                slots = [[cgutils.alloca_once_value(builder, builder.load(ptrs[i][c], align=4)) for c in range(k)]
                         for i in range(n_q)]
                # keys lane, lane + 32, ... below used
                n_keys = builder.udiv(builder.add(builder.sub(used_, lane), const(31)), const(32))
                with cgutils.for_range(builder, n_keys) as keys:
                    j = builder.add(lane, builder.mul(keys.index, const(32)))
                    slot = builder.load(builder.gep(mp, [builder.add(k0_, j)]))
                    vb = builder.add(builder.add(builder.mul(slot, row_stride_), v_off_), d0)
                    vals = [_load_v8f(builder, vp, builder.add(vb, const(8 * c)), half) for c in range(k)]
                    for i in range(n_q):
                        at = builder.add(poffs[i], j)
                        keep = builder.fcmp_unordered("!=", builder.load(builder.gep(ep, [at])), zero)
                        pv = _splat(builder, builder.load(builder.gep(pp, [at])), _V8F)
                        for c in range(k):
                            old = builder.load(slots[i][c])
                            builder.store(builder.select(keep, _fma(builder, vals[c], pv, old), old), slots[i][c])
                for i in range(n_q):
                    for c in range(k):
                        builder.store(builder.load(slots[i][c]), ptrs[i][c], align=4)

            n_lanes = builder.select(builder.icmp_unsigned("<", used_, const(32)), used_, const(32))
            with cgutils.for_range(builder, n_lanes) as lanes:
                lane = lanes.index
                with cgutils.for_range(builder, builder.udiv(n_main, const(8 * k_main))) as ds:
                    stretch(lane, builder.mul(ds.index, const(8 * k_main)), k_main)
                if k_main > 1:
                    with cgutils.for_range(builder, builder.udiv(builder.sub(n_, n_main), const(8))) as ds:
                        stretch(lane, builder.add(n_main, builder.mul(ds.index, const(8))), 1)
            return context.get_dummy_value()

        return sig, codegen

    return pv_lanes


pv_lanes1, pv_lanes2, pv_lanes3, pv_lanes4 = (_pv_lanes(n) for n in (1, 2, 3, 4))


@intrinsic
def pv_t(typingctx, vt, vt_off, vt_stride, p, n_keys, n, out, out_off):
    """out[out_off + d] = sum_j p[j] vt[vt_off + d vt_stride + j] for d < n (a multiple of 4) over
    j < n_keys (a multiple of 8): V^T's rows times the probabilities in tinyBLAS's order (one
    8-lane accumulator per element, key j in lane j % 8, fma(v, p, acc) in key order, then
    hsum_float_8). Four rows of V^T at a time, each block of p loaded once for them; vt float32
    or float16 bits (uint16)."""
    half = vt.dtype == types.uint16
    sig = types.void(vt, types.uint64, types.uint64, p, types.uint64, types.uint64, out, types.uint64)

    def codegen(context, builder, signature, args):
        vt_, vt_off_, vt_stride_, p_, n_keys_, n_, out_, out_off_ = args
        vp = _ptr(context, builder, signature.args[0], vt_)
        pp = _ptr(context, builder, signature.args[3], p_)
        op = _ptr(context, builder, signature.args[6], out_)
        with cgutils.for_range(builder, builder.udiv(n_, const(4))) as dl:
            d = builder.mul(dl.index, const(4))
            rows = [builder.add(vt_off_, builder.mul(builder.add(d, const(r)), vt_stride_)) for r in range(4)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for _ in range(4)]
            with cgutils.for_range(builder, builder.udiv(n_keys_, const(8))) as kl:
                j0 = builder.mul(kl.index, const(8))
                pv = _load_vec(builder, pp, j0, _V8F)
                for r in range(4):
                    vv = _load_v8f(builder, vp, builder.add(rows[r], j0), half)
                    builder.store(_fma(builder, vv, pv, builder.load(accs[r])), accs[r])
            for r in range(4):
                builder.store(_hsum8(builder, builder.load(accs[r])),
                              builder.gep(op, [builder.add(out_off_, builder.add(d, const(r)))]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def axpy_f16(typingctx, v, v_off, p, acc, acc_off, n):
    """acc[acc_off + d] = fma(float(v[v_off + d]), p, acc[acc_off + d]) for d < n (a multiple of
    8): v float16 bits (uint16) or float32, p float32, acc float32; explicit 8-wide vectors."""
    half = v.dtype == types.uint16
    sig = types.void(v, types.uint64, types.float32, acc, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        v_, v_off_, p_, acc_, acc_off_, n_ = args
        vp = _ptr(context, builder, signature.args[0], v_)
        ap = _ptr(context, builder, signature.args[3], acc_)
        pv = _splat(builder, p_, _V8F)
        steps = builder.udiv(n_, ir.Constant(_I64, 8))
        with cgutils.for_range(builder, steps) as loop:
            o = builder.mul(loop.index, ir.Constant(_I64, 8))
            if half:
                raw = _load_vec(builder, vp, builder.add(v_off_, o), ir.VectorType(ir.IntType(16), 8))
                vf = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8)), _V8F)
            else:
                vf = _load_vec(builder, vp, builder.add(v_off_, o), _V8F)
            aptr = builder.bitcast(builder.gep(ap, [builder.add(acc_off_, o)]), _V8F.as_pointer())
            builder.store(_fma(builder, vf, pv, builder.load(aptr, align=4)), aptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def rowdot_q2_k(typingctx, w, w_off, xq, x_off, xd, xs, b_off, nb):
    """float32: a Q2_K row (84-byte super-blocks: scales[16] (sc | min << 4), qs[64], d, dmin)
    times x in Q8_K form, in ggml's x86 order: per super-block first
    acc = fma(-d_x * dmin_w, lanes of min * (x sums), acc) (lane k: groups 2k and 2k+1), then
    acc = fma(d_x * d_w, lanes of sc * q * x, acc) (lane j: weights 4j..4j+3 of every 32); the
    result hsum_float_8(acc)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, xs, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, xs_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)
        sp = _ptr(context, builder, signature.args[5], xs_)
        i32 = ir.IntType(32)

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(84)))
            _prefetch_row(builder, wp, o, 84)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            bi = builder.add(b_off_, i)
            s16 = builder.mul(bi, const(16))
            scb = [builder.zext(builder.load(builder.gep(wp, [builder.add(o, const(k))])), i32) for k in range(16)]
            sc = [builder.and_(b, ir.Constant(i32, 15)) for b in scb]
            mn = [builder.lshr(b, ir.Constant(i32, 4)) for b in scb]
            mins = ir.Constant(_i32(8), [0] * 8)
            for lane in range(8):
                v = builder.add(builder.mul(mn[2 * lane], builder.load(builder.gep(sp, [builder.add(s16, const(2 * lane))]))),
                                builder.mul(mn[2 * lane + 1],
                                            builder.load(builder.gep(sp, [builder.add(s16, const(2 * lane + 1))]))))
                mins = builder.insert_element(mins, v, ir.Constant(i32, lane))
            dx = builder.load(builder.gep(dp, [bi]))
            d = builder.fmul(dx, _load_half(builder, wp, builder.add(o, const(80))))
            dmin = builder.fmul(builder.fneg(dx), _load_half(builder, wp, builder.add(o, const(82))))
            acc = _fma(builder, _splat(builder, dmin, _V8F), builder.sitofp(mins, _V8F), acc)
            sumi = ir.Constant(_i32(8), [0] * 8)
            for j in range(2):
                bits = _load_vec(builder, wp, builder.add(o, const(16 + 32 * j)), _i8(32))
                for k in range(4):
                    q = builder.and_(builder.lshr(bits, ir.Constant(_i8(32), [2 * k] * 32)), ir.Constant(_i8(32), [3] * 32))
                    y = _load_vec(builder, xp, builder.add(xo, const(128 * j + 32 * k)), _i8(32))
                    g = 8 * j + 2 * k
                    sumi = builder.add(sumi, _scaled_quads(builder, q, y, sc[g], sc[g + 1]))
            acc = _fma(builder, _splat(builder, d, _V8F), builder.sitofp(sumi, _V8F), acc)
            return acc, s

        acc, _ = _block_loop(context, builder, nb_, body)
        return _hsum8(builder, acc)

    return sig, codegen


def _maddubs16(builder, u8, s8):
    """<16 x i16>: lane j = u8[2j] s8[2j] + u8[2j+1] s8[2j+1] (pmaddubsw; u8 small, no saturation)."""
    if AVX2:
        return builder.call(_fn(builder, "llvm.x86.avx2.pmadd.ub.sw", _i16(16), [_i8(32), _i8(32)]), [u8, s8])
    prod = builder.mul(builder.zext(u8, _i16(32)), builder.sext(s8, _i16(32)))
    return builder.add(builder.shuffle_vector(prod, prod, ir.Constant(_i32(16), list(range(0, 32, 2)))),
                       builder.shuffle_vector(prod, prod, ir.Constant(_i32(16), list(range(1, 32, 2)))))


@intrinsic
def rowdot_q3_k(typingctx, w, w_off, xq, x_off, xd, b_off, nb):
    """float32: a Q3_K row (110-byte super-blocks: hmask[32], qs[64], scales[12], d) times x in
    Q8_K form, in ggml's x86 order: per super-block eight int32 lanes (lane j: sc * q * x of
    weights 4j..4j+3 of every 32, q = low 2 bits - 4 unless the hmask bit is set), then
    acc = fma(d_x * d_w, lanes, acc); the result hsum_float_8(acc)."""
    sig = types.float32(w, types.uint64, xq, types.uint64, xd, types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        w_, w_off_, xq_, x_off_, xd_, b_off_, nb_ = args
        wp = _ptr(context, builder, signature.args[0], w_)
        xp = _ptr(context, builder, signature.args[2], xq_)
        dp = _ptr(context, builder, signature.args[4], xd_)
        i32 = ir.IntType(32)

        def byte(o, k):
            return builder.zext(builder.load(builder.gep(wp, [builder.add(o, const(k))])), i32)

        def bits(v, shift, mask):
            return builder.and_(builder.lshr(v, ir.Constant(i32, shift)), ir.Constant(i32, mask))

        def body(i, acc, s):
            o = builder.add(w_off_, builder.mul(i, const(110)))
            _prefetch_row(builder, wp, o, 110)
            xo = builder.add(x_off_, builder.mul(i, const(256)))
            # the 16 6-bit scales as <16 x i16>, from scales[12]: low nibbles of bytes 0..7 then
            # their high nibbles; 2 high bits from bytes 8..11, shifted by 2 (g // 4)
            b8 = builder.bitcast(builder.load(builder.bitcast(builder.gep(wp, [builder.add(o, const(96))]),
                                                              ir.IntType(64).as_pointer()), align=1), _i8(8))
            b4 = builder.bitcast(builder.load(builder.bitcast(builder.gep(wp, [builder.add(o, const(104))]),
                                                              i32.as_pointer()), align=1), _i8(4))
            lo = builder.shuffle_vector(b8, builder.lshr(b8, ir.Constant(_i8(8), [4] * 8)),
                                        ir.Constant(_i32(16), list(range(16))))
            lo = builder.and_(lo, ir.Constant(_i8(16), [15] * 16))
            parts = [builder.lshr(b4, ir.Constant(_i8(4), [2 * k] * 4)) for k in range(4)]
            hi = builder.shuffle_vector(builder.shuffle_vector(parts[0], parts[1], ir.Constant(_i32(8), list(range(8)))),
                                        builder.shuffle_vector(parts[2], parts[3], ir.Constant(_i32(8), list(range(8)))),
                                        ir.Constant(_i32(16), list(range(16))))
            hi = builder.shl(builder.and_(hi, ir.Constant(_i8(16), [3] * 16)), ir.Constant(_i8(16), [4] * 16))
            sc16 = builder.sub(builder.sext(builder.or_(lo, hi), _i16(16)), ir.Constant(_i16(16), [32] * 16))
            hmask = _load_vec(builder, wp, o, _i8(32))
            not_h = builder.xor(hmask, ir.Constant(_i8(32), [-1] * 32))
            sumi = ir.Constant(_i32(8), [0] * 8)
            for c in range(2):
                qbits = _load_vec(builder, wp, builder.add(o, const(32 + 32 * c)), _i8(32))
                for s_ in range(4):
                    low = builder.and_(qbits if s_ == 0 else builder.lshr(qbits, ir.Constant(_i8(32), [2 * s_] * 32)),
                                       ir.Constant(_i8(32), [3] * 32))
                    k = 4 * c + s_  # the hmask bit: 4 where it is clear
                    four = (builder.shl(not_h, ir.Constant(_i8(32), [2 - k] * 32)) if k < 2 else
                            builder.lshr(not_h, ir.Constant(_i8(32), [k - 2] * 32)) if k > 2 else not_h)
                    four = builder.and_(four, ir.Constant(_i8(32), [4] * 32))
                    y = _load_vec(builder, xp, builder.add(xo, const(128 * c + 32 * s_)), _i8(32))
                    g = 8 * c + 2 * s_
                    # (low - four) . y per pair of bytes, exact in int16 (|.| <= 2 * 4 * 128)
                    p16 = builder.sub(_maddubs16(builder, low, y), _maddubs16(builder, four, y))
                    sc = builder.shuffle_vector(sc16, sc16, ir.Constant(_i32(16), [g] * 8 + [g + 1] * 8))
                    sumi = builder.add(sumi, _madd16(builder, p16, sc))
            d = builder.fmul(builder.load(builder.gep(dp, [builder.add(b_off_, i)])),
                             _load_half(builder, wp, builder.add(o, const(108))))
            acc = _fma(builder, _splat(builder, d, _V8F), builder.sitofp(sumi, _V8F), acc)
            return acc, s

        acc, _ = _block_loop(context, builder, nb_, body)
        return _hsum8(builder, acc)

    return sig, codegen


# --- unpacking K-quant super-blocks for the tiled product (kquants._unpack_sb) ----------------
def unpack_codes_kind(kind):
    """unpack_q<kind>_k(row, o, wq, w0): the 256 codes of the Q<kind>_K super-block at byte o of row as
    unsigned bytes wq[w0 + i] (weight i, code = q + offset: see kquants._unpack_sb), as 32-byte
    vector steps."""
    @intrinsic
    def unpack(typingctx, row, o, wq, w0):
        sig = types.void(row, types.uint64, wq, types.uint64)

        def codegen(context, builder, signature, args):
            row_, o_, wq_, w0_ = args
            rp = _ptr(context, builder, signature.args[0], row_)
            wp = _ptr(context, builder, signature.args[2], wq_)

            def at(off):
                return _load_vec(builder, rp, builder.add(o_, const(off)), _i8(32))

            def bits(v, shift, mask):
                if shift:
                    v = builder.lshr(v, ir.Constant(_i8(32), [shift] * 32))
                return builder.and_(v, ir.Constant(_i8(32), [mask] * 32))

            def put(i, v):
                ptr = builder.bitcast(builder.gep(wp, [builder.add(w0_, const(32 * i))]), _i8(32).as_pointer())
                builder.store(v, ptr, align=1)

            def shl(v, n):
                return builder.shl(v, ir.Constant(_i8(32), [n] * 32))

            if kind == 2:  # qs at 16
                for c in range(2):
                    q = at(16 + 32 * c)
                    for s in range(4):
                        put(4 * c + s, bits(q, 2 * s, 3))
            elif kind == 3:  # hmask at 0, qs at 32
                hm = at(0)
                for c in range(2):
                    q = at(32 + 32 * c)
                    for s in range(4):
                        put(4 * c + s, builder.or_(bits(q, 2 * s, 3), shl(bits(hm, 4 * c + s, 1), 2)))
            elif kind in (4, 5):  # (Q5_K: qh at 16) qs at 16 / 48
                qs = 16 if kind == 4 else 48
                qh = at(16) if kind == 5 else None
                for c in range(4):
                    q = at(qs + 32 * c)
                    for n in range(2):
                        b = 2 * c + n
                        v = bits(q, 4 * n, 15)
                        if kind == 5:
                            v = builder.or_(v, shl(bits(qh, b, 1), 4))
                        put(b, v)
            else:  # Q6_K: ql at 0, qh at 128
                for h in range(2):
                    qh = at(128 + 32 * h)
                    for t in range(4):
                        lo = bits(at(64 * h + 32 * (t & 1)), 4 * (t >> 1), 15)
                        put(4 * h + t, builder.or_(lo, shl(bits(qh, 2 * t, 3), 4)))
            return context.get_dummy_value()

        return sig, codegen

    return unpack


unpack_q2_k, unpack_q3_k, unpack_q4_k, unpack_q5_k, unpack_q6_k = (unpack_codes_kind(k) for k in (2, 3, 4, 5, 6))
