"""A decode step of a whole model's transformer blocks in a single Numba call.

A token's block is ~15 small kernels; called one by one from Python each costs a few microseconds
of dispatch plus a parallel-region launch (~5 us with two threads, measured), which for SmolLM2
(30 blocks, 0.5-2 MB of weights each) was a third of the decode step. Here a block runs with five
parallel regions: the q/k/v rows together, attention, the output projection, the gate/up rows with
the activation, the down projection; and every block of the step runs in the same call
(`decode_layers` loops over a table of the layers' weights, norms and caches), so the ~40 us of
Python and argument dispatch per block are paid once a step. The arithmetic is the unfused kernels' own (the same row dot products in ggml's order,
the same norm / RoPE / attention / activation code), so the results are identical bit for bit
(tests/test_models.py holds them together).

A step may hold one decode token of each of up to max_tokens(types) sequences (16 for a block of legacy
types, 7 with K-quants; models/decoder.py ALONE_MAX): they
go through the block in the same call, each row kernel taking its chunk of rows once for all of
them (the rows stay in the cache for the tokens after the first), each token with the one-token
kernels and order — the bits it gets decoded alone — and its own key list in the attention.

Weights must be of a type with a row kernel here (`ROW_TYPES`); CPUBackend runs other layers
through the unfused ops.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from numba import carray
from numba import types as nbtypes
from numba.core import cgutils
from numba.extending import intrinsic, overload

from edgellm.kernels.cpu.ir import kquants as ir_kquants
from edgellm.kernels.cpu.ir import packed, rows8
from edgellm.kernels.cpu.common import F32, U, njit, outlined, prange, quantize_q8_32, quantize_q8_k
from edgellm.kernels.cpu.ir.vecmath import silu_mul_v8
from edgellm.kernels.cpu.kquants import row_q4_k
from edgellm.kernels.cpu.attention import attend_decode_inline
from edgellm.kernels.cpu.ops import add_rms_norm, gelu_ggml, prepare_qkv, rms_norm
from edgellm.kernels.cpu.legacy import row_q4_0
from edgellm.kernels.cpu.ir.legacy import rowdot_q4_1, rowdot_q5_0, rowdot_q8_0
from edgellm.kernels.cpu.ir.tiles import rowdot1_q5_1
from edgellm.kernels.cpu.ir.rows8 import rows8_q4_0, rows8_q5_0, rows8_q8_0

# The K-quant row kernels, each a function of its own that _rows calls (common.outlined): inlined
# into decode_layers, which holds every K-quant's kernels, they run slower than alone. The legacy
# types' kernels stay inlined: a call per row of a small model's few blocks costs more than it
# saves (docs/performance.md, standing decisions).
(rowdot_q2_k, rowdot_q3_k, rowdot_q5_k, rowdot_q6_k, rowdotx2_q6_k, rowdotx4_q6_k, il8_q4_k, rows8_q4_k, il8x2_q4_k,
 il8x3_q4_k, il8n4_q4_k) = (
    outlined(k) for k in (ir_kquants.rowdot_q2_k, ir_kquants.rowdot_q3_k, ir_kquants.rowdot_q5_k,
                          ir_kquants.rowdot_q6_k, ir_kquants.rowdotx2_q6_k, ir_kquants.rowdotx4_q6_k,
                          packed.il8_q4_k, rows8.rows8_q4_k, packed.il8x2_q4_k, packed.il8x3_q4_k,
                          packed.il8n4_q4_k))

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = (int(t) for t in (
    GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K,
    GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K))
# Q4_K rows packed by eight (Matrix.pack, kquants.pack8_q4_k): a kernel id of its own in the
# layer table, not a ggml type (the weights are those of the Q4_K matrix, in another layout)
Q4_K8 = 1000 + Q4_K
ROW_ORDER = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_K8)
ROW_TYPES = frozenset(ROW_ORDER)
K_TYPES = frozenset((Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_K8))  # activations in Q8_K form (the others: Q8_0 / Q8_1)


def type_mask(types) -> tuple:
    """decode_layers' `mask` argument for a block whose weights are of `types` (ROW_TYPES): (0 if a
    type with Q8_0 / Q8_1 activations is among them else None, the same for the K-quants). Numba
    compiles decode_layers once per mask, with the row kernels and activation form of the families
    present only: an all-legacy model (SmolLM2's Q4_1) compiles no K-quant kernel and an all-K
    model no legacy one (the first run's decode compile ~25% shorter), and a test suite going
    through every type compiles at most three variants per block layout."""
    types = frozenset(int(t) for t in types)
    return (0 if types - K_TYPES else None, 0 if types & K_TYPES else None)


def _present(mask) -> frozenset:
    """The types decode_layers is compiled for, from its mask's Numba type (at compile time)."""
    legacy, k = (not isinstance(ty, nbtypes.NoneType) for ty in mask.types)
    return (ROW_TYPES - K_TYPES if legacy else frozenset()) | (K_TYPES if k else frozenset())


@njit(inline="always")
def _is_k(tid):
    """The type takes its activations in Q8_K form (the others: Q8_0 / Q8_1, "q8_32")."""
    return tid == Q2_K or tid == Q3_K or tid == Q4_K or tid == Q5_K or tid == Q6_K or tid == Q4_K8


def max_tokens(types) -> int:
    """How many decode tokens (of different sequences) a block of `types` takes through
    decode_layers: from 8 tokens on the K-quants' batch products (tiled) beat the one-token row
    kernels, the legacy types' do not (`edgellm bench --parallel`; docs/performance.md)."""
    return 7 if any(int(t) in K_TYPES for t in types) else 16


CHUNK = 16  # rows per call of _rows: the type dispatch and call cost once per chunk
# Every product's parallel loop has one iteration per thread, each a contiguous run of chunks (for
# the gate and up rows: its run of one matrix, then the same rows of the other, then their
# activation), so a thread reads each matrix as one stream (switching matrices more often read
# slower from memory: docs/performance.md, standing decisions).


@njit(inline="always")
def _share(th, n_threads, n):
    """Thread th's first item of n split in n_threads contiguous runs."""
    return th * n // n_threads


@njit(inline="always")
def _qkv_cut(b, cq, rq, ck, rk, cv, rv):
    """The first chunk at or after byte b of the q, k, v chunks in a row (cq chunks of row bytes rq,
    then ck of rk, then cv of rv): the q/k/v loop's threads split the bytes, not the chunk count
    (a Q6_K v is 1.46 times a Q4_K k's bytes per row)."""
    if b <= cq * rq:
        return (b + rq - 1) // rq
    b -= cq * rq
    if b <= ck * rk:
        return cq + (b + rk - 1) // rk
    b -= ck * rk
    return min(cq + ck + (b + rv - 1) // rv, cq + ck + cv)


def _rows(mask, tid, w, c, out, a32, ak, n_in, n_tok):
    """Rows [c * CHUNK, (c + 1) * CHUNK) of w (clipped) times each of n_tok tokens' activations
    (token t's at t n_in values / t n_in / 32 or / 256 blocks of the buffers) into out (token t's
    row at t w.shape[0]): one compiled copy of each present type's row kernel (`mask`), called from
    every parallel loop of decode_layers (the type test once per chunk). The chunk's rows stay in the
    cache for the tokens after the first; each (row, token) is the one-token kernel's result.
    Compiled only inside decode_layers (the overload below)."""
    raise NotImplementedError("called from decode_layers' compiled code only")


@overload(_rows, jit_options={"nogil": True})
def _rows_overload(mask, tid, w, c, out, a32, ak, n_in, n_tok):
    return _rows_for(_present(mask))


def _rows_for(present: frozenset):
    """_rows for the types in `present`: the absent types' branches test a False constant, which
    Numba prunes before typing, so their row kernels are never compiled."""
    has_q4_0, has_q4_1, has_q5_0, has_q5_1, has_q8_0, has_q2_k, has_q3_k, has_q4_k, has_q5_k, has_q6_k, has_q4_k8 = (
        t in present for t in ROW_ORDER)

    def rows(mask, tid, w, c, out, a32, ak, n_in, n_tok):
        r0 = c * CHUNK
        r1 = min(r0 + CHUNK, w.shape[0])
        rb, n_out = U(w.shape[1]), U(w.shape[0])
        n32, nk = U(n_in // 32), U(n_in // 256)
        if has_q4_k8 and tid == Q4_K8:  # packed by eight: up to four tokens per read of the rows
            for r in range(r0, r1, 8):
                t = 0
                while t < n_tok:
                    m = min(n_tok - t, 4)
                    b0, o0 = U(t) * nk, U(t) * n_out + U(r)
                    if m == 4:
                        il8n4_q4_k(w, U(r) * rb, ak[0], ak[1], ak[2], b0, nk, out, o0, n_out)
                    elif m == 3:
                        il8x3_q4_k(w, U(r) * rb, ak[0], ak[1], ak[2], b0, nk, out, o0, n_out)
                    elif m == 2:
                        il8x2_q4_k(w, U(r) * rb, ak[0], ak[1], ak[2], b0, nk, out, o0, n_out)
                    else:
                        il8_q4_k(w, U(r) * rb, ak[0], ak[1], ak[2], b0, nk, out, o0)
                    t += m
            return
        if has_q6_k and tid == Q6_K:  # each row's codes unpacked once for up to four tokens
            for r in range(r0, r1):
                t = 0
                while t < n_tok:
                    m = n_tok - t
                    xo, bk, oo = U(t) * U(n_in), U(t) * nk, U(t) * n_out + U(r)
                    if m >= 4:
                        rowdotx4_q6_k(w, U(r) * rb, ak[0], xo, ak[1], ak[2], bk, nk, out, oo, n_out)
                        t += 4
                    elif m >= 2:
                        rowdotx2_q6_k(w, U(r) * rb, ak[0], xo, ak[1], ak[2], bk, nk, out, oo, n_out)
                        t += 2
                    else:
                        out[oo] = rowdot_q6_k(w, U(r) * rb, ak[0], xo, ak[1], ak[2], bk, nk)
                        t += 1
            return
        for t in range(U(n_tok)):
            xo, b32, bk, oo = t * U(n_in), t * n32, t * nk, t * n_out
            if has_q4_1 and tid == Q4_1:
                for r in range(r0, r1):
                    out[oo + r] = rowdot_q4_1(w, U(r) * rb, a32[0], xo, a32[1], a32[3], b32, n32)
            elif has_q5_0 and tid == Q5_0:
                r8 = r0 + (r1 - r0) // 8 * 8
                for r in range(r0, r8, 8):  # eight rows at a time: the same sums (rows8)
                    rows8_q5_0(w, U(r) * rb, rb, a32[0], xo, a32[1], b32, n32, out, oo + U(r))
                for r in range(r8, r1):
                    out[oo + r] = rowdot_q5_0(w, U(r) * rb, a32[0], xo, a32[1], b32, n32)
            elif has_q8_0 and tid == Q8_0:
                r8 = r0 + (r1 - r0) // 8 * 8
                for r in range(r0, r8, 8):  # eight rows at a time: the same sums (rows8)
                    rows8_q8_0(w, U(r) * rb, rb, a32[0], xo, a32[1], b32, n32, out, oo + U(r))
                for r in range(r8, r1):
                    out[oo + r] = rowdot_q8_0(w, U(r) * rb, a32[0], xo, a32[1], b32, n32)
            elif has_q4_0 and tid == Q4_0:
                r8 = r0 + (r1 - r0) // 8 * 8
                for r in range(r0, r8, 8):  # eight rows at a time: the same sums (rows8)
                    rows8_q4_0(w, U(r) * rb, rb, a32[0], a32[1], a32[2], b32, n32, out, oo + U(r))
                for r in range(r8, r1):
                    out[oo + r] = row_q4_0(w[r], a32[0], a32[1], a32[2], t, n32)
            elif has_q5_1 and tid == Q5_1:
                for r in range(r0, r1):
                    out[oo + r] = rowdot1_q5_1(w, U(r) * rb, a32[0], xo, U(0), a32[1], a32[3], b32, n32)
            elif has_q5_k and tid == Q5_K:
                for r in range(r0, r1):
                    out[oo + r] = rowdot_q5_k(w, U(r) * rb, ak[0], xo, ak[1], ak[2], bk, nk)
            elif has_q3_k and tid == Q3_K:
                for r in range(r0, r1):
                    out[oo + r] = rowdot_q3_k(w, U(r) * rb, ak[0], xo, ak[1], bk, nk)
            elif has_q2_k and tid == Q2_K:
                for r in range(r0, r1):
                    out[oo + r] = rowdot_q2_k(w, U(r) * rb, ak[0], xo, ak[1], ak[2], bk, nk)
            elif has_q4_k and tid == Q4_K:
                r8 = r0 + (r1 - r0) // 8 * 8
                for r in range(r0, r8, 8):
                    rows8_q4_k(w, U(r) * rb, rb, ak[0], ak[1], ak[2], bk, nk, out, oo + U(r))
                for r in range(r8, r1):
                    out[oo + r] = row_q4_k(w[r], ak[0], ak[1], ak[2], t, nk, False)

    return rows


def _quantize(mask, x, a32, ak, need32, needk):
    """The rows of x (n_tok, n) into the activation buffers, row t at t n values (t n / 32 and
    t n / 256 blocks): the Q8_0 / Q8_1 form if need32, the Q8_K form if needk — each compiled only
    when a type of `mask` takes it. Compiled only inside decode_layers (the overload below)."""
    raise NotImplementedError("called from decode_layers' compiled code only")


@overload(_quantize, jit_options={"nogil": True})
def _quantize_overload(mask, x, a32, ak, need32, needk):
    present = _present(mask)
    any32, anyk = bool(present - K_TYPES), bool(present & K_TYPES)

    def quantize(mask, x, a32, ak, need32, needk):
        n = x.shape[1]
        for t in range(x.shape[0]):
            o = t * n
            if any32 and need32:
                quantize_q8_32(x[t], a32[0][o:o + n], a32[1][o // 32:(o + n) // 32], a32[2][o // 32:(o + n) // 32],
                               a32[3][o // 32:(o + n) // 32])
            if anyk and needk:
                quantize_q8_k(x[t], ak[0][o:o + n], ak[1][o // 256:(o + n) // 256], ak[2][o // 16:(o + n) // 16],
                              ak[3])

    return quantize


# decode_layers' layer table: one int64 row per layer, addresses and sizes of what the layer's
# block reads (the arrays stay owned by the caller, which keeps them alive during the call).
T_NORMS = 0  # 9 x (address, length): attn_norm, post_attn_norm, ffn_norm, post_ffw_norm, q_norm, k_norm, bq, bk, bv
T_W = 18  # 7 x (address, rows, row bytes): wq, wk, wv, wo, wg, wu, wd
T_TIDS = 39  # 7 ggml types, in the same order
T_KC, T_VC = 46, 50  # (address, slots, n_kv, head dim): the layer's K and V cache (f16 bits)
T_KPOS = 54  # (address, length): the slot positions of the layer's cache group
T_WINDOW, T_GROUP, T_ROPE = 56, 57, 58  # sliding window (0: none), the step-layout group, the RoPE table
T_COLS = 59


@intrinsic
def _voidptr(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return nbtypes.voidptr(nbtypes.int64), codegen


@njit(inline="always")
def _vec(t, c, dtype):
    return carray(_voidptr(t[c]), (t[c + 1],), dtype)


@njit(inline="always")
def _mat(t, c):
    return carray(_voidptr(t[c]), (t[c + 1], t[c + 2]), np.uint8)


@njit(inline="always")
def _cache(t, c):
    return carray(_voidptr(t[c]), (t[c + 1], t[c + 2], t[c + 3]), np.uint16)


@njit(cache=True, nogil=True, parallel=True)
def decode_layers(x, h, q, k, v, att, o, gate, up, a32, ak, table, mask,
                  eps, rope, pos, n_rot, neox, slots, kmap, kbeg, kend, scale, gelu, gelu_table, q_scale,
                  n_threads):
    """n decode tokens (each of its own sequence) through the blocks of `table` (T_COLS columns, one
    row a layer, in order), in place on x (n, n_embd): a whole model's decode step in one call.
    q (n, n_head, hd), k / v (n, n_kv, hd), att (n, n_head * hd_v), o / h (n, n_embd), gate / up
    (n, n_ff): scratch. a32 / ak: activation buffers (q8_32 and q8_k parts) for n rows of the
    widest input. mask: type_mask of every layer's types. rope (n_tables, 4): (cos address, sin
    address, positions, n_rot / 2) of float32 tables. Norms and biases of length 0 are absent. In
    layer group g, token t's K and V go to cache slot slots[g, t] and it attends to the slots
    kmap[kbeg[g, t]:kend[g, t]]. Every token gets what it gets through these blocks alone, bit for
    bit (the one-token kernels and order); each layer's weights are read once for the n. n_threads:
    Numba's thread count (each product's parallel loop takes a run of rows per thread; a count read
    in here would keep the kernel out of the disk cache)."""
    n_tok, n_embd = x.shape
    for il in range(table.shape[0]):
        t = table[il]
        attn_norm, post_attn_norm = _vec(t, T_NORMS, np.float32), _vec(t, T_NORMS + 2, np.float32)
        ffn_norm, post_ffw_norm = _vec(t, T_NORMS + 4, np.float32), _vec(t, T_NORMS + 6, np.float32)
        q_norm, k_norm = _vec(t, T_NORMS + 8, np.float32), _vec(t, T_NORMS + 10, np.float32)
        bq, bk, bv = _vec(t, T_NORMS + 12, np.float32), _vec(t, T_NORMS + 14, np.float32), _vec(t, T_NORMS + 16, np.float32)
        wq, wk, wv, wo = _mat(t, T_W), _mat(t, T_W + 3), _mat(t, T_W + 6), _mat(t, T_W + 9)
        wg, wu, wd = _mat(t, T_W + 12), _mat(t, T_W + 15), _mat(t, T_W + 18)
        tids = t[T_TIDS:T_TIDS + 7]
        kc, vc = _cache(t, T_KC), _cache(t, T_VC)
        kpos = _vec(t, T_KPOS, np.int64)
        window, g, r = t[T_WINDOW], t[T_GROUP], t[T_ROPE]
        cos = carray(_voidptr(rope[r, 0]), (rope[r, 2], rope[r, 3]), np.float32)
        sin = carray(_voidptr(rope[r, 1]), (rope[r, 2], rope[r, 3]), np.float32)
        # attention: norm, q/k/v rows in one parallel loop
        rms_norm(x, attn_norm, eps, h)
        need32 = not (_is_k(tids[0]) and _is_k(tids[1]) and _is_k(tids[2]))
        needk = _is_k(tids[0]) or _is_k(tids[1]) or _is_k(tids[2])
        _quantize(mask, h, a32, ak, need32, needk)
        n_in_qkv = n_embd
        qf, kf, vf = q.reshape(-1), k.reshape(-1), v.reshape(-1)
        cq, ck, cv = (wq.shape[0] + CHUNK - 1) // CHUNK, (wk.shape[0] + CHUNK - 1) // CHUNK, (wv.shape[0] + CHUNK - 1) // CHUNK
        rq, rk, rv = wq.shape[1], wk.shape[1], wv.shape[1]
        n_bytes = cq * rq + ck * rk + cv * rv
        for th in prange(n_threads):
            c0 = _qkv_cut(_share(th, n_threads, n_bytes), cq, rq, ck, rk, cv, rv)
            c1 = _qkv_cut(_share(th + 1, n_threads, n_bytes), cq, rq, ck, rk, cv, rv)
            for c in range(c0, c1):
                if c < cq:
                    _rows(mask, tids[0], wq, c, qf, a32, ak, n_in_qkv, n_tok)
                elif c < cq + ck:
                    _rows(mask, tids[1], wk, c - cq, kf, a32, ak, n_in_qkv, n_tok)
                else:
                    _rows(mask, tids[2], wv, c - cq - ck, vf, a32, ak, n_in_qkv, n_tok)
        prepare_qkv(q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, pos, n_rot, neox, kc, vc, kpos, slots[g],
                    q_scale)
        attend_decode_inline(q, kc, vc, kpos, kmap, kbeg[g], kend[g], pos, window, scale, att, kc[0, 0, 0])
        # output projection, residual, ffn norm
        n_att = att.shape[1]
        _quantize(mask, att, a32, ak, not _is_k(tids[3]), _is_k(tids[3]))
        n_in_o = n_att
        of = o.reshape(-1)
        n_chunks = (wo.shape[0] + CHUNK - 1) // CHUNK
        for th in prange(n_threads):
            for c in range(_share(th, n_threads, n_chunks), _share(th + 1, n_threads, n_chunks)):
                _rows(mask, tids[3], wo, c, of, a32, ak, n_in_o, n_tok)
        add_rms_norm(x, o, post_attn_norm, ffn_norm, eps, h)
        # gated FFN
        need32 = not (_is_k(tids[4]) and _is_k(tids[5]))
        needk = _is_k(tids[4]) or _is_k(tids[5])
        _quantize(mask, h, a32, ak, need32, needk)
        n_in_ffn = n_embd
        gf, uf = gate.reshape(-1), up.reshape(-1)
        n_ff = wg.shape[0]
        n8 = n_ff // 8 * 8
        # a thread's run of gate rows, the same run of up rows, then their activation, in one
        # parallel loop (the activation was a serial loop over n_ff after it)
        n_chunks = (n_ff + CHUNK - 1) // CHUNK
        for th in prange(n_threads):
            c0, c1 = _share(th, n_threads, n_chunks), _share(th + 1, n_threads, n_chunks)
            for c in range(c0, c1):
                _rows(mask, tids[4], wg, c, gf, a32, ak, n_in_ffn, n_tok)
            for c in range(c0, c1):
                _rows(mask, tids[5], wu, c, uf, a32, ak, n_in_ffn, n_tok)
            lo, hi = c0 * CHUNK, min(c1 * CHUNK, n_ff)
            for tk in range(n_tok):
                t0 = tk * n_ff
                if gelu:  # ggml's GEGLU
                    for j in range(t0 + lo, t0 + hi):
                        gf[j] = gelu_ggml(gf[j], gelu_table) * uf[j]
                else:  # SiLU: ggml's vector exp eight lanes at a time (lo, and hv unless it is n8, are multiples of 16)
                    hv = max(lo, min(hi, n8))
                    silu_mul_v8(gf, uf, gf, U(t0 + lo), U(hv - lo))
                    for j in range(t0 + hv, t0 + hi):  # ggml's scalar tail: expf
                        gf[j] = gf[j] / (F32(1.0) + np.exp(-gf[j])) * uf[j]
        _quantize(mask, gate, a32, ak, not _is_k(tids[6]), _is_k(tids[6]))
        n_in_down = n_ff
        n_chunks = (wd.shape[0] + CHUNK - 1) // CHUNK
        for th in prange(n_threads):
            for c in range(_share(th, n_threads, n_chunks), _share(th + 1, n_threads, n_chunks)):
                _rows(mask, tids[6], wd, c, of, a32, ak, n_in_down, n_tok)
        add_rms_norm(x, o, post_ffw_norm, post_ffw_norm[:0], eps, x)
