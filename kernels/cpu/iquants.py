"""The 4-bit non-linear types: IQ4_NL (blocks of 32, activations "q8_32") and IQ4_XS (super-blocks
of 256, activations "q8_k").

Same entry points as legacy.py / kquants.py: `dequantize_<t>(raw, out, lanes)`,
`matvec_<t>(raw, xq, xd, xs, xm, out)` and a batch product in MATMUL. A 4-bit code q stands for
the signed 8-bit value KVALUES[q] (ggml's kvalues_iq4nl); byte i of a 16-byte group holds weight
i (low nibble) and weight i + 16 (high nibble), as in Q4_0.

    IQ4_NL  d:f16 | qs:u8[16]                                  w = d * KVALUES[q]
    IQ4_XS  d:f16 | scales_h:u16 | scales_l:u8[4] | qs:u8[128]; sub-block s (32 weights, qs[16s:16s+16]):
            ls = (nibble s % 2 of scales_l[s // 2]) | ((scales_h >> 2s) & 3) << 4
            w = (d * (ls - 32)) * KVALUES[q]

The products sum in the order of what llama.cpp's AVX2 CPU build runs for the matrix (the integer
sums are exact, so only the float steps below are order-sensitive; reference.py spells each out):
  IQ4_NL, row count a multiple of 8 (llama.cpp repacks it, iq4_nl_8x8; gemv and gemm alike):
      per block acc = fma(f32(isum), d_w * d_x, acc)
  IQ4_NL, other row counts: one token as ggml_vec_dot_iq4_nl_q8_0 (even and odd blocks in two
      8-lane accumulators, lane j the sum of weights 4j..4j+3; hsum_float_8 of their sum; an odd
      last block added as fma(d_x * d_w, f32(isum), sum)); two or more tokens as tinyBLAS (one
      8-lane accumulator, fma(d_w * d_x, lanes, acc); hsum)
  IQ4_XS, fewer than 8 tokens: ggml_vec_dot_iq4_xs_q8_K (per super-block 8 integer lanes
      sum_s (ls_s - 32) * quad sums, acc = fma(d_w * d_x, f32(lanes), acc); hsum_float_8)
  IQ4_XS, 8 tokens or more: llama.cpp's tiled kernel: per super-block res = d_w * f32(s1),
      acc = fma(res, d_x, acc), s1 the super-block's exact scaled integer sum
Dequantize follows gguf.quants operation for operation: bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from edgellm.kernels.cpu.host import AVX2, F16C
from edgellm.kernels.cpu import igrid as _igrid
from edgellm.kernels.cpu.common import F32, I32, JIT, KVALUES, U, f16_to_f32, hsum8, load_f16, njit, prange, xs_scale
from edgellm.kernels.cpu.ir.builder import abs_sign, fma8, fma8_vec, fma32, i32, i8, llvm_fn, load_bytes, quad_sums, splat
from edgellm.kernels.cpu.ir.iquants import IQ4_XS_BYTES, iq4_values, rowdot_iq4_xs


# Bytes per block, as the sum of its fields.
IQ4_NL_BYTES = 2 + 16  # d | qs[16]
TILED_MIN = 8  # IQ4_XS batches from this many tokens on take llama.cpp's tiled order
REPACK_ROWS = 8  # IQ4_NL matrices with a multiple of this many rows are repacked by llama.cpp


# --- one 32-weight block's integer products, as LLVM vector IR ---------------------------------
# The 16 code bytes become 32 int8 values with one byte shuffle (pshufb on the value table, as
# ggml does), then |w| x sign(x, w) pair sums (pmaddubsw: |w| <= 127, |x| <= 127, so the pair sums
# fit int16) and quad sums (pmaddwd): lane j = weights 4j .. 4j + 3, exact.
def _iq4_quads(builder, raw, xv):
    """<8 x i32>: lane j = sum of value * x over weights 4j .. 4j + 3 of one block."""
    return quad_sums(builder, *abs_sign(builder, iq4_values(builder, raw), xv))


def _block_quads(context, builder, signature, args):
    raw = load_bytes(context, builder, signature.args[0], args[0], args[1], 16)
    xv = load_bytes(context, builder, signature.args[2], args[2], args[3], 32)
    return _iq4_quads(builder, raw, xv)


@intrinsic
def _dot32(typingctx, w, w_off, x, x_off):
    """int32: sum of KVALUES[code] * x over the 32 weights of the 16 code bytes at w[w_off:] (uint8)
    and the 32 int8 activations at x[x_off:] (exact)."""
    sig = types.int32(w, types.uint64, x, types.uint64)

    def codegen(context, builder, signature, args):
        q = _block_quads(context, builder, signature, args)
        return builder.call(llvm_fn(builder, "llvm.vector.reduce.add.v8i32", ir.IntType(32), [i32(8)]), [q])

    return sig, codegen


@intrinsic
def _fma_quads(typingctx, w, w_off, x, x_off, d, acc):
    """acc[0:8] (float32) = fma(d, f32(the block's eight quad sums), acc), lane by lane."""
    sig = types.none(w, types.uint64, x, types.uint64, types.float32, acc)

    def codegen(context, builder, signature, args):
        fma8(context, builder, signature, args[4], _block_quads(context, builder, signature, args), args[5], 5)
        return context.get_dummy_value()

    return sig, codegen


def _sum8(builder, vecs):
    """Eight <8 x i32> -> <8 x i32>: lane r = the sum of vecs[r]'s lanes (exact)."""
    evens = ir.Constant(i32(8), [0, 2, 4, 6, 8, 10, 12, 14])
    odds = ir.Constant(i32(8), [1, 3, 5, 7, 9, 11, 13, 15])
    while len(vecs) > 1:  # pairwise: lanes of a then of b, each pair of neighbours summed
        vecs = [builder.add(builder.shuffle_vector(a, b, evens), builder.shuffle_vector(a, b, odds))
                for a, b in zip(vecs[0::2], vecs[1::2])]
    return vecs[0]


@intrinsic
def _rows8_iq4_nl(typingctx, w, w_off, rb, x, x_off, dx, acc):
    """Eight IQ4_NL rows at once, one block each: for the blocks at bytes w_off + r rb (r < 8) of
    w and the 32 int8 activations at x[x_off:] with scale dx, acc[r] = fma(f32(isum_r), d_r * dx,
    acc[r]) (float32 acc[0:8], llama.cpp's repacked order; its gemv holds eight rows in a vector
    too). Needs F16C (the eight f16 d_r)."""
    sig = types.none(w, types.uint64, types.uint64, x, types.uint64, types.float32, acc)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        xv = load_bytes(context, builder, signature.args[3], args[3], args[4], 32)
        f8 = ir.VectorType(ir.FloatType(), 8)
        quads, dvec = [], ir.Constant(f8, ir.Undefined)
        for r in range(8):
            off = builder.add(args[1], builder.mul(args[2], ir.Constant(ir.IntType(64), r)))
            ptr = builder.gep(data, [off])
            raw = builder.load(builder.bitcast(builder.gep(ptr, [ir.Constant(ir.IntType(64), 2)]),
                                               i8(16).as_pointer()), align=1)
            quads.append(_iq4_quads(builder, raw, xv))
            half = builder.bitcast(builder.load(builder.bitcast(ptr, ir.IntType(16).as_pointer()), align=1),
                                   ir.HalfType())
            dvec = builder.insert_element(dvec, builder.fpext(half, ir.FloatType()), ir.Constant(ir.IntType(32), r))
        scale = builder.fmul(dvec, splat(builder, args[5], f8))
        fma8_vec(context, builder, signature, builder.sitofp(_sum8(builder, quads), f8), scale, args[6], 6)
        return context.get_dummy_value()

    return sig, codegen


# --- dequantize ----------------------------------------------------------------------------
@njit(**JIT)
def dequantize_iq4_nl(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 32)):
            o, w = b * U(IQ4_NL_BYTES), b * U(32)
            d = f16_to_f32(row[o], row[o + U(1)])
            for j in range(lanes):
                c = row[o + U(2) + j]
                dst[w + j] = d * F32(KVALUES[c & U(15)])
                dst[w + U(16) + j] = d * F32(KVALUES[c >> U(4)])


@njit(**JIT)
def dequantize_iq4_xs(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for b in range(U(out.shape[1] // 256)):
            o, w = b * U(IQ4_XS_BYTES), b * U(256)
            d = f16_to_f32(row[o], row[o + U(1)])
            for s in range(U(8)):
                dl = d * F32(xs_scale(row, o, s))
                q = o + U(8) + U(16) * s
                for j in range(lanes):
                    c = row[q + j]
                    dst[w + U(32) * s + j] = dl * F32(KVALUES[c & U(15)])
                    dst[w + U(32) * s + U(16) + j] = dl * F32(KVALUES[c >> U(4)])


# --- IQ4_NL row dot products (x: "q8_32" parts, token t's blocks at t * nb ...) ------------------
@njit(inline="always")
def row_iq4_nl_repacked(row, xq, xd, t, nb):
    """llama.cpp's repacked order (iq4_nl_8x8 gemv / gemm): acc = fma(f32(isum), d_w * d_x, acc)."""
    acc = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        acc = fma32(F32(_dot32(row, o + U(2), xq, b * U(32))), load_f16(row, o) * xd[b], acc)
    return acc


@njit(inline="always")
def rows4_iq4_nl_repacked(w0, w1, w2, w3, xq, xd, t, nb):
    """row_iq4_nl_repacked of four rows at once (four independent fma chains)."""
    a0 = a1 = a2 = a3 = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        xo, dx = b * U(32), xd[b]
        a0 = fma32(F32(_dot32(w0, o + U(2), xq, xo)), load_f16(w0, o) * dx, a0)
        a1 = fma32(F32(_dot32(w1, o + U(2), xq, xo)), load_f16(w1, o) * dx, a1)
        a2 = fma32(F32(_dot32(w2, o + U(2), xq, xo)), load_f16(w2, o) * dx, a2)
        a3 = fma32(F32(_dot32(w3, o + U(2), xq, xo)), load_f16(w3, o) * dx, a3)
    return a0, a1, a2, a3


ROWS8 = AVX2 and F16C  # rows8_iq4_nl_repacked's vector form (else four scalar chains)


@njit(inline="always")
def rows8_iq4_nl_repacked(raw, r, rb, xq, xd, t, nb, acc):
    """row_iq4_nl_repacked of rows r .. r + 7 of raw (2-D) into acc[0:8] (float32, overwritten)."""
    for i in range(8):
        acc[i] = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        _rows8_iq4_nl(raw, r * rb + j * U(IQ4_NL_BYTES), rb, xq, b * U(32), xd[b], acc)


@njit(inline="always")
def tokens4_iq4_nl_repacked(row, xq, xd, t, nb):
    """row_iq4_nl_repacked of one row for tokens t .. t + 3."""
    a0 = a1 = a2 = a3 = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        dw = load_f16(row, o)
        a0 = fma32(F32(_dot32(row, o + U(2), xq, b * U(32))), dw * xd[b], a0)
        a1 = fma32(F32(_dot32(row, o + U(2), xq, (b + nb) * U(32))), dw * xd[b + nb], a1)
        a2 = fma32(F32(_dot32(row, o + U(2), xq, (b + U(2) * nb) * U(32))), dw * xd[b + U(2) * nb], a2)
        a3 = fma32(F32(_dot32(row, o + U(2), xq, (b + U(3) * nb) * U(32))), dw * xd[b + U(3) * nb], a3)
    return a0, a1, a2, a3


@njit(inline="always")
def row_iq4_nl_vec_dot(row, xq, xd, t, nb, a1, a2):
    """ggml_vec_dot_iq4_nl_q8_0 (AVX2): blocks 2i into a1, 2i + 1 into a2 (8 float32 lanes each,
    scratch), hsum_float_8(a1 + a2), then an odd last block as a scalar fma."""
    for lane in range(8):
        a1[lane] = F32(0.0)
        a2[lane] = F32(0.0)
    j = U(0)
    while j + U(1) < nb:
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        _fma_quads(row, o + U(2), xq, b * U(32), load_f16(row, o) * xd[b], a1)
        _fma_quads(row, o + U(IQ4_NL_BYTES + 2), xq, (b + U(1)) * U(32),
                   load_f16(row, o + U(IQ4_NL_BYTES)) * xd[b + U(1)], a2)
        j += U(2)
    for lane in range(8):
        a1[lane] = a1[lane] + a2[lane]
    s = hsum8(a1)
    if j < nb:
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        s = fma32(xd[b] * load_f16(row, o), F32(_dot32(row, o + U(2), xq, b * U(32))), s)
    return s


@njit(inline="always")
def row_iq4_nl_tinyblas(row, xq, xd, t, nb, a1):
    """tinyBLAS_Q0_AVX (llama.cpp's batches of unrepacked IQ4_NL): one 8-lane accumulator,
    acc = fma(d_w * d_x, lanes, acc) per block; hsum."""
    for lane in range(8):
        a1[lane] = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_NL_BYTES)
        _fma_quads(row, o + U(2), xq, b * U(32), load_f16(row, o) * xd[b], a1)
    return hsum8(a1)


@njit(**JIT)
def matvec_iq4_nl(raw, xq, xd, xs, xm, out):
    """Repacked rows four at a time; other row counts as vec_dot, 16 rows per parallel iteration."""
    nb = U(xd.size)
    n = raw.shape[0]
    if n % REPACK_ROWS == 0 and ROWS8:
        rb = U(raw.shape[1])
        for g in prange(n // 8):
            rows8_iq4_nl_repacked(raw, U(8 * g), rb, xq, xd, U(0), nb, out[8 * g:8 * g + 8])
    elif n % REPACK_ROWS == 0:
        for g in prange(n // 4):
            r = 4 * g
            out[r], out[r + 1], out[r + 2], out[r + 3] = rows4_iq4_nl_repacked(
                raw[r], raw[r + 1], raw[r + 2], raw[r + 3], xq, xd, U(0), nb)
    else:
        for c in prange((n + 15) // 16):
            a1, a2 = np.empty(8, F32), np.empty(8, F32)
            for r in range(c * 16, min(c * 16 + 16, n)):
                out[r] = row_iq4_nl_vec_dot(raw[r], xq, xd, U(0), nb, a1, a2)


@njit(**JIT)
def matmul_iq4_nl(raw, xq, xd, xs, xm, out):
    """out (n_tok, n_rows); x the tokens' "q8_32" parts end to end. Rows by chunks of 16, every
    token over a chunk while its weights are in the cache (repacked: four tokens at a time)."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    repacked = n_rows % REPACK_ROWS == 0
    if repacked and ROWS8:
        rb = U(raw.shape[1])
        for c in prange((n_rows + 15) // 16):
            for t in range(n_tok):
                for r in range(c * 16, min(c * 16 + 16, n_rows), 8):
                    rows8_iq4_nl_repacked(raw, U(r), rb, xq, xd, U(t), nb, out[t, r:r + 8])
        return
    n4 = n_tok - n_tok % 4 if repacked else 0
    for c in prange((n_rows + 15) // 16):
        a1, a2 = np.empty(8, F32), np.empty(8, F32)
        r1 = min(c * 16 + 16, n_rows)
        for t in range(0, n4, 4):
            for r in range(c * 16, r1):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = tokens4_iq4_nl_repacked(
                    raw[r], xq, xd, U(t), nb)
        for t in range(n4, n_tok):
            for r in range(c * 16, r1):
                if repacked:
                    out[t, r] = row_iq4_nl_repacked(raw[r], xq, xd, U(t), nb)
                elif n_tok == 1:
                    out[t, r] = row_iq4_nl_vec_dot(raw[r], xq, xd, U(t), nb, a1, a2)
                else:
                    out[t, r] = row_iq4_nl_tinyblas(raw[r], xq, xd, U(t), nb, a1)


# --- IQ4_XS row dot products (x: "q8_k" parts, token t's super-blocks at t * nb ...) ---------------
@njit(inline="always")
def row_iq4_xs_vec_dot(row, xq, xd, t, nb):
    """ggml_vec_dot_iq4_xs_q8_K (AVX2), token t: see ir.iquants.rowdot_iq4_xs."""
    return rowdot_iq4_xs(row, U(0), xq, t * nb * U(256), xd, t * nb, nb)


@njit(inline="always")
def _s1_iq4_xs(row, o, xq, x):
    """The exact scaled integer sum of one IQ4_XS super-block (at byte o) with x at xq[x:]."""
    s1 = I32(0)
    for sb in range(U(8)):
        s1 += xs_scale(row, o, sb) * _dot32(row, o + U(8) + U(16) * sb, xq, x + U(32) * sb)
    return s1


@njit(inline="always")
def row_iq4_xs_tiled(row, xq, xd, t, nb):
    """llama.cpp's tiled order: per super-block res = d_w * f32(s1), acc = fma(res, d_x, acc)."""
    acc = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_XS_BYTES)
        acc = fma32(load_f16(row, o) * F32(_s1_iq4_xs(row, o, xq, b * U(256))), xd[b], acc)
    return acc


@njit(inline="always")
def tokens4_iq4_xs_tiled(row, xq, xd, t, nb):
    """row_iq4_xs_tiled for tokens t .. t + 3 (four independent fma chains)."""
    a0 = a1 = a2 = a3 = F32(0.0)
    for j in range(nb):
        b = t * nb + j
        o = j * U(IQ4_XS_BYTES)
        dw = load_f16(row, o)
        a0 = fma32(dw * F32(_s1_iq4_xs(row, o, xq, b * U(256))), xd[b], a0)
        a1 = fma32(dw * F32(_s1_iq4_xs(row, o, xq, (b + nb) * U(256))), xd[b + nb], a1)
        a2 = fma32(dw * F32(_s1_iq4_xs(row, o, xq, (b + U(2) * nb) * U(256))), xd[b + U(2) * nb], a2)
        a3 = fma32(dw * F32(_s1_iq4_xs(row, o, xq, (b + U(3) * nb) * U(256))), xd[b + U(3) * nb], a3)
    return a0, a1, a2, a3


@njit(**JIT)
def matvec_iq4_xs(raw, xq, xd, xs, xm, out):
    nb = U(xd.size)
    n = raw.shape[0]
    for c in prange((n + 15) // 16):
        for r in range(c * 16, min(c * 16 + 16, n)):
            out[r] = row_iq4_xs_vec_dot(raw[r], xq, xd, U(0), nb)


@njit(**JIT)
def matmul_iq4_xs(raw, xq, xd, xs, xm, out):
    """out (n_tok, n_rows); x the tokens' "q8_k" parts end to end: the tiled order from TILED_MIN
    tokens on, the one-token order below."""
    n_tok, n_rows = out.shape
    nb = U(xd.size // n_tok)
    tiled = n_tok >= TILED_MIN
    if tiled and _igrid.W16:  # int16 weights times ls - 32 by vpdpwssd, as the grid types
        _igrid._tiled_w16(9, raw, xq, xd, out)
        return
    n4 = n_tok - n_tok % 4 if tiled else 0
    for c in prange((n_rows + 15) // 16):
        r1 = min(c * 16 + 16, n_rows)
        for t in range(0, n4, 4):
            for r in range(c * 16, r1):
                out[t, r], out[t + 1, r], out[t + 2, r], out[t + 3, r] = tokens4_iq4_xs_tiled(
                    raw[r], xq, xd, U(t), nb)
        for t in range(n4, n_tok):
            for r in range(c * 16, r1):
                if tiled:
                    out[t, r] = row_iq4_xs_tiled(raw[r], xq, xd, U(t), nb)
                else:
                    out[t, r] = row_iq4_xs_vec_dot(raw[r], xq, xd, U(t), nb)


KERNELS = {
    GGMLType.IQ4_NL: (dequantize_iq4_nl, matvec_iq4_nl),
    GGMLType.IQ4_XS: (dequantize_iq4_xs, matvec_iq4_xs),
}
MATMUL = {GGMLType.IQ4_NL: matmul_iq4_nl, GGMLType.IQ4_XS: matmul_iq4_xs}
