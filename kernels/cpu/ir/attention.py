"""Decode attention's pieces over the f16 (or f32) KV cache, in the orders llama.cpp's CPU attention
sums them: scores of several heads sharing a KV head (dot4_heads*, scores_heads*), value sums in
vec_dot_f16's 32 lanes (pv_lanes*), V^T times the probabilities in tinyBLAS's order (pv_t), and an
f16 axpy (axpy_f16). A key or value row is loaded and converted once for all the heads that read it.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import REGS32
from edgellm.kernels.cpu.ir.builder import F32_T, I64_T, V8F, array_ptr, const, fma, hsum8, load_v8f, load_vec, splat

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
            kp = array_ptr(context, builder, signature.args[0], k_)
            qp = array_ptr(context, builder, signature.args[3], q_)
            sp = array_ptr(context, builder, signature.args[7], s_)
            koffs = [builder.add(k_off_, builder.mul(const(r), k_stride_)) for r in range(4)]
            qoffs = [builder.add(q_off_, builder.mul(const(i), q_stride_)) for i in range(n_q)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(4)]
                    for _ in range(n_q)]
            with cgutils.for_range(builder, builder.udiv(n_, const(8))) as loop:
                o = builder.mul(loop.index, const(8))
                qvs = [load_vec(builder, qp, builder.add(qo, o), V8F) for qo in qoffs]
                for r in range(4):
                    kv = load_v8f(builder, kp, builder.add(koffs[r], o), half)
                    for i in range(n_q):
                        builder.store(fma(builder, kv, qvs[i], builder.load(accs[i][r])), accs[i][r])
            for i in range(n_q):
                row = builder.add(s_off_, builder.mul(const(i), s_stride_))
                for r in range(4):
                    builder.store(hsum8(builder, builder.load(accs[i][r])),
                                  builder.gep(sp, [builder.add(row, const(r))]))
            return context.get_dummy_value()

        return sig, codegen

    return dot4_heads


dot4_heads1, dot4_heads2, dot4_heads3 = (_dot4_heads(n) for n in (1, 2, 3))


def _scores_heads_ir(n_q):
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
            kp = array_ptr(context, builder, signature.args[0], k_)
            mp = array_ptr(context, builder, signature.args[1], kmap_)
            qp = array_ptr(context, builder, signature.args[6], q_)
            sp = array_ptr(context, builder, signature.args[10], s_)
            qoffs = [builder.add(q_off_, builder.mul(const(i), q_stride_)) for i in range(n_q)]
            soffs = [builder.add(s_off_, builder.mul(const(i), s_stride_)) for i in range(n_q)]
            zero = ir.Constant(V8F, [0.0] * 8)
            with cgutils.for_range(builder, used_) as keys:
                j = keys.index
                slot = builder.load(builder.gep(mp, [builder.add(k0_, j)]))
                base = builder.add(builder.mul(slot, row_stride_), k_off_)
                accs = [[cgutils.alloca_once(builder, V8F) for _ in range(4)] for _ in range(n_q)]
                for row in accs:
                    for a in row:
                        builder.store(zero, a)
                with cgutils.for_range(builder, builder.udiv(n_, const(32))) as loop:
                    o = builder.mul(loop.index, const(32))
                    for a in range(4):
                        oa = builder.add(o, const(8 * a))
                        kv = load_v8f(builder, kp, builder.add(base, oa), half)
                        for i in range(n_q):
                            qv = load_vec(builder, qp, builder.add(qoffs[i], oa), V8F)
                            builder.store(fma(builder, kv, qv, builder.load(accs[i][a])), accs[i][a])
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


scores_heads1, scores_heads2, scores_heads3, scores_heads4 = (_scores_heads_ir(n) for n in (1, 2, 3, 4))


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
            vp = array_ptr(context, builder, signature.args[0], v_)
            mp = array_ptr(context, builder, signature.args[1], kmap_)
            ep = array_ptr(context, builder, signature.args[6], e_)
            pp = array_ptr(context, builder, signature.args[7], p_)
            ap = array_ptr(context, builder, signature.args[10], acc_)
            poffs = [builder.add(p_off_, builder.mul(const(i), p_stride_)) for i in range(n_q)]
            zero = ir.Constant(F32_T, 0.0)
            n_main = builder.mul(builder.udiv(n_, const(8 * k_main)), const(8 * k_main))

            def stretch(lane, d0, k):
                """Lane `lane`'s accumulators of values d0 .. d0 + 8k of every head over its keys."""
                rows = [builder.add(builder.add(acc_off_, builder.mul(const(i), acc_stride_)),
                                    builder.add(builder.mul(lane, n_), d0)) for i in range(n_q)]
                ptrs = [[builder.bitcast(builder.gep(ap, [builder.add(rows[i], const(8 * c))]), V8F.as_pointer())
                         for c in range(k)] for i in range(n_q)]
                slots = [[cgutils.alloca_once_value(builder, builder.load(ptrs[i][c], align=4)) for c in range(k)]
                         for i in range(n_q)]
                # keys lane, lane + 32, ... below used
                n_keys = builder.udiv(builder.add(builder.sub(used_, lane), const(31)), const(32))
                with cgutils.for_range(builder, n_keys) as keys:
                    j = builder.add(lane, builder.mul(keys.index, const(32)))
                    slot = builder.load(builder.gep(mp, [builder.add(k0_, j)]))
                    vb = builder.add(builder.add(builder.mul(slot, row_stride_), v_off_), d0)
                    vals = [load_v8f(builder, vp, builder.add(vb, const(8 * c)), half) for c in range(k)]
                    for i in range(n_q):
                        at = builder.add(poffs[i], j)
                        keep = builder.fcmp_unordered("!=", builder.load(builder.gep(ep, [at])), zero)
                        pv = splat(builder, builder.load(builder.gep(pp, [at])), V8F)
                        for c in range(k):
                            old = builder.load(slots[i][c])
                            builder.store(builder.select(keep, fma(builder, vals[c], pv, old), old), slots[i][c])
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
        vp = array_ptr(context, builder, signature.args[0], vt_)
        pp = array_ptr(context, builder, signature.args[3], p_)
        op = array_ptr(context, builder, signature.args[6], out_)
        with cgutils.for_range(builder, builder.udiv(n_, const(4))) as dl:
            d = builder.mul(dl.index, const(4))
            rows = [builder.add(vt_off_, builder.mul(builder.add(d, const(r)), vt_stride_)) for r in range(4)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, [0.0] * 8)) for _ in range(4)]
            with cgutils.for_range(builder, builder.udiv(n_keys_, const(8))) as kl:
                j0 = builder.mul(kl.index, const(8))
                pv = load_vec(builder, pp, j0, V8F)
                for r in range(4):
                    vv = load_v8f(builder, vp, builder.add(rows[r], j0), half)
                    builder.store(fma(builder, vv, pv, builder.load(accs[r])), accs[r])
            for r in range(4):
                builder.store(hsum8(builder, builder.load(accs[r])),
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
        vp = array_ptr(context, builder, signature.args[0], v_)
        ap = array_ptr(context, builder, signature.args[3], acc_)
        pv = splat(builder, p_, V8F)
        steps = builder.udiv(n_, ir.Constant(I64_T, 8))
        with cgutils.for_range(builder, steps) as loop:
            o = builder.mul(loop.index, ir.Constant(I64_T, 8))
            if half:
                raw = load_vec(builder, vp, builder.add(v_off_, o), ir.VectorType(ir.IntType(16), 8))
                vf = builder.fpext(builder.bitcast(raw, ir.VectorType(ir.HalfType(), 8)), V8F)
            else:
                vf = load_vec(builder, vp, builder.add(v_off_, o), V8F)
            aptr = builder.bitcast(builder.gep(ap, [builder.add(acc_off_, o)]), V8F.as_pointer())
            builder.store(fma(builder, vf, pv, builder.load(aptr, align=4)), aptr, align=4)
        return context.get_dummy_value()

    return sig, codegen


# --- a cache element: f16 bits or float32 --------------------------------------------------------
@intrinsic
def cache_load(typingctx, x):
    """float32 of a cache element: uint16 (float16 bits) or float32."""
    if x == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen
    if x == types.float32:
        def ident(context, builder, sig, args):
            return args[0]
        return types.float32(types.float32), ident
    return None


@intrinsic
def cache_store(typingctx, x, like):
    """float32 x as a cache element of like's type: float16 bits (round to nearest even) or float32."""
    if like == types.uint16:
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32, types.uint16), codegen
    if like == types.float32:
        def ident(context, builder, sig, args):
            return args[0]
        return types.float32(types.float32, types.float32), ident
    return None
