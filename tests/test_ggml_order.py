"""The kernels that sum in ggml's order return, bit for bit, what their NumPy references
(kernels/cpu/reference.py) return: matvec, and matmul token by token (also across the four-token
groups of the repacked Q4_K order). Outlier activations, as in the real models, make the order
visible: a plain float sum differs from these results in the last bits."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edgellm.kernels import cpu
from edgellm.kernels.cpu import reference as ref
from edgellm.synthetic import quantize

RNG = np.random.default_rng(7)


def _weights(ggml_type, n_rows=24, n_cols=1024):
    w = RNG.standard_normal((n_rows, n_cols)).astype(np.float32)
    return np.ascontiguousarray(quantize(w, ggml_type))


def _x(n_tok, n_cols=1024):
    x = RNG.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, 5] *= 200.0  # an outlier channel, like SmolLM2's
    return x


def _reference(ggml_type, raw, x_row, per_pair=False):
    fmt = cpu.activation_format(ggml_type)
    xq, xd, xs, xm = cpu.quantize(fmt, x_row).parts
    if ggml_type == T.Q4_1:
        return ref.rowdot_q4_1(raw, xq, xd, xm)
    if ggml_type == T.Q8_0:
        return ref.rowdot_q8_0(raw, xq, xd)
    if ggml_type == T.Q5_0:
        return ref.rowdot_q5_0(raw, xq, xd)
    if ggml_type == T.Q6_K:
        return ref.rowdot_q6_k(raw, xq, xd, xs)
    if ggml_type == T.Q5_1:
        return ref.rowdot_q5_1(raw, xq, xd, xm)
    if ggml_type == T.Q4_0:
        return ref.rowdot_q4_0(raw, xq, xd, xs)
    if ggml_type == T.Q5_K:
        return ref.rowdot_q5_k(raw, xq, xd, xs)
    if ggml_type == T.Q2_K:
        return ref.rowdot_q2_k(raw, xq, xd, xs)
    if ggml_type == T.Q3_K:
        return ref.rowdot_q3_k(raw, xq, xd)
    return ref.rowdot_q4_k(raw, xq, xd, xs, per_pair)


EXACT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


@pytest.mark.parametrize("ggml_type", EXACT_TYPES)
def test_matvec_is_bit_exact_with_the_reference(ggml_type):
    raw = _weights(ggml_type)
    m = cpu.bind(ggml_type, raw, 1024)
    x = _x(1)[0]
    out = np.empty(raw.shape[0], np.float32)
    m.matvec(x, out)
    np.testing.assert_array_equal(out, _reference(ggml_type, raw, x))
    # and the order matters: the float64 product of the same integers differs in the last bits
    xr = cpu.requantize(cpu.activation_format(ggml_type), x[None])[0]
    w = np.empty((raw.shape[0], 1024), np.float32)
    m.dequantize(w)
    assert not np.array_equal(out, (w.astype(np.float64) @ xr).astype(np.float32))


@pytest.mark.parametrize("ggml_type", EXACT_TYPES)
@pytest.mark.parametrize("n_tok", [2, 7])
def test_matmul_rows_are_the_reference_rows(ggml_type, n_tok):
    raw = _weights(ggml_type)
    m = cpu.bind(ggml_type, raw, 1024)
    x = _x(n_tok)
    out = np.empty((n_tok, raw.shape[0]), np.float32)
    m.matmul(x, out)
    n_gemm = n_tok - n_tok % 4  # Q4_K: llama.cpp's gemm takes four tokens at a time
    for t in range(n_tok):
        expect = _reference(ggml_type, raw, x[t], per_pair=t < n_gemm)
        np.testing.assert_array_equal(out[t], expect, err_msg=f"token {t}")


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_legacy_batches_of_eight_or_more_keep_the_one_token_rows(ggml_type):
    """The legacy types' batch products (Q8_0 with VNNI: two rows x eight tokens (AVX-512) or four
    (AVX-VNNI) per call, then four-token tiles, then one; an odd row left) are llama.cpp's vec_dot
    row for every token."""
    raw = _weights(ggml_type, n_rows=27)
    m = cpu.bind(ggml_type, raw, 1024)
    x = _x(23)  # two groups of eight, one of four, three left over
    out = np.empty((23, 27), np.float32)
    m.matmul(x, out)
    for t in range(23):
        np.testing.assert_array_equal(out[t], _reference(ggml_type, raw, x[t]), err_msg=f"token {t}")


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_batches_of_eight_or_more_take_the_tiled_order(ggml_type):
    """From 8 tokens on llama.cpp multiplies K-quants with its tiled kernel (Q4_K: when it does
    not repack it, i.e. the row count is not a multiple of 8): another float order."""
    n_rows = 20 if ggml_type == T.Q4_K else 27  # 27: a chunk of rows is cut short
    raw = _weights(ggml_type, n_rows=n_rows)
    m = cpu.bind(ggml_type, raw, 1024)
    x = _x(23)  # two groups of eight tokens, one of four, three left over
    out = np.empty((23, n_rows), np.float32)
    m.matmul(x, out)
    name = ggml_type.name.lower()
    for t in range(23):
        xq, xd, xs, _ = cpu.quantize("q8_k", x[t]).parts
        np.testing.assert_array_equal(out[t], ref.rowdot_tiled(name, raw, xq, xd, xs), err_msg=f"token {t}")
    assert not np.array_equal(out[0], _reference(ggml_type, raw, x[0]))  # not the one-token order


@pytest.mark.parametrize("n_tok", [10, 13])
def test_repacked_q4_k_batches_take_four_tokens_per_pair_then_one_per_super_block(n_tok):
    """Q4_K with a row count that is a multiple of 8 (llama.cpp repacks it): every batch size
    takes the repacked order, its four-token steps per pair of sub-blocks and the tokens past
    the last group of four the one-token order."""
    raw = _weights(T.Q4_K, n_rows=24)
    m = cpu.bind(T.Q4_K, raw, 1024)
    x = _x(n_tok)
    out = np.empty((n_tok, 24), np.float32)
    m.matmul(x, out)
    n_gemm = n_tok - n_tok % 4
    for t in range(n_tok):
        np.testing.assert_array_equal(out[t], _reference(T.Q4_K, raw, x[t], per_pair=t < n_gemm),
                                      err_msg=f"token {t}")
    assert not np.array_equal(out[0], _reference(T.Q4_K, raw, x[0], per_pair=False))


# --- IQ4_NL / IQ4_XS: random codes (every nibble) with f16 scales; IQ4_XS's packed 6-bit scales too --
def _iq4_rows(ggml_type, n_rows, n_cols):
    from quant_blocks import random_rows

    return random_rows(ggml_type, n_rows, n_cols, seed=n_rows * 7 + n_cols)


def _iq4_reference(ggml_type, raw, x_row, order):
    xq, xd, _, _ = cpu.quantize(cpu.activation_format(ggml_type), x_row).parts
    if ggml_type == T.IQ4_NL:
        return ref.rowdot_iq4_nl(raw, xq, xd, order)
    return ref.rowdot_iq4_xs(raw, xq, xd, tiled=order == "tiled")


@pytest.mark.parametrize("n_rows, n_cols", [(24, 1024), (24, 1056), (21, 1024), (21, 1056), (5, 32)])
@pytest.mark.parametrize("n_tok", [1, 2, 7])
def test_iq4_nl_products_follow_llama_cpp_by_row_count(n_rows, n_cols, n_tok):
    """IQ4_NL: rows repacked by llama.cpp (a multiple of 8) take the iq4_nl_8x8 order for every
    token; other row counts take vec_dot_iq4_nl_q8_0 for one token (1056 columns: an odd block
    count, the scalar tail) and tinyBLAS for a batch."""
    raw = _iq4_rows(T.IQ4_NL, n_rows, n_cols)
    m = cpu.bind(T.IQ4_NL, raw, n_cols)
    x = _x(n_tok, n_cols)
    out = np.empty((n_tok, n_rows), np.float32)
    m.matmul(x, out)
    order = "repacked" if n_rows % 8 == 0 else "vec_dot" if n_tok == 1 else "tinyblas"
    for t in range(n_tok):
        np.testing.assert_array_equal(out[t], _iq4_reference(T.IQ4_NL, raw, x[t], order), err_msg=f"token {t}")
    one = np.empty(n_rows, np.float32)
    m.matvec(x[0], one)
    np.testing.assert_array_equal(one, _iq4_reference(T.IQ4_NL, raw, x[0], "repacked" if n_rows % 8 == 0
                                                      else "vec_dot"))
    if n_cols > 32:  # the three orders are three different sums
        results = [_iq4_reference(T.IQ4_NL, raw, x[0], o) for o in ("repacked", "vec_dot", "tinyblas")]
        assert not np.array_equal(results[0], results[1]) and not np.array_equal(results[1], results[2])


@pytest.mark.parametrize("n_rows", [24, 27])
@pytest.mark.parametrize("n_tok", [1, 7, 8, 19])
def test_iq4_xs_products_take_vec_dot_below_eight_tokens_and_the_tiled_order_from_eight(n_rows, n_tok):
    raw = _iq4_rows(T.IQ4_XS, n_rows, 1024)
    m = cpu.bind(T.IQ4_XS, raw, 1024)
    x = _x(n_tok)
    out = np.empty((n_tok, n_rows), np.float32)
    m.matmul(x, out)
    order = "tiled" if n_tok >= 8 else "vec_dot"
    for t in range(n_tok):
        np.testing.assert_array_equal(out[t], _iq4_reference(T.IQ4_XS, raw, x[t], order), err_msg=f"token {t}")
    one = np.empty(n_rows, np.float32)
    m.matvec(x[0], one)
    np.testing.assert_array_equal(one, _iq4_reference(T.IQ4_XS, raw, x[0], "vec_dot"))
    assert not np.array_equal(one, _iq4_reference(T.IQ4_XS, raw, x[0], "tiled"))


@pytest.mark.parametrize("ggml_type", [T.IQ4_NL, T.IQ4_XS])
def test_iq4_numpy_dequantizers_equal_gguf(ggml_type):
    """The references' own decoding of the blocks (reference.dequantize_iq4_*) is gguf-py's, bit for
    bit, on random blocks: every code, every 6-bit IQ4_XS scale (ls - 32 from -32 to 31)."""
    from gguf.quants import dequantize

    raw = _iq4_rows(ggml_type, 64, 512)
    mine = (ref.dequantize_iq4_nl if ggml_type == T.IQ4_NL else ref.dequantize_iq4_xs)(raw)
    want = np.asarray(dequantize(raw, ggml_type), np.float32).reshape(mine.shape)
    assert np.array_equal(mine.view(np.uint32), want.view(np.uint32))
    if ggml_type == T.IQ4_XS:
        scales = np.concatenate([ref.iq4_xs_scales(raw[:, 136 * b:136 * b + 136]) for b in range(2)])
        assert scales.min() == -32 and scales.max() == 31

@pytest.mark.parametrize("ggml_type", [T.F16, T.BF16])
@pytest.mark.parametrize("n_tok", [1, 3])
def test_float_weights_follow_vec_dot_for_one_token_and_tinyblas_for_more(ggml_type, n_tok):
    raw = _weights(ggml_type).view(np.uint8)
    m = cpu.bind(ggml_type, raw, 1024)
    x = _x(n_tok)
    out = np.empty((n_tok, raw.shape[0]), np.float32)
    m.matmul(x, out)
    w = np.empty((raw.shape[0], 1024), np.float32)
    m.dequantize(w)
    fmt = cpu.activation_format(ggml_type)
    for t in range(n_tok):
        xr = cpu.quantize(fmt, x[t]).parts[0]
        expect = ref.dot_f16(w, xr, 4 if n_tok == 1 else 1, bf16=ggml_type == T.BF16)
        np.testing.assert_array_equal(out[t], expect, err_msg=f"token {t}")
    if n_tok == 1:  # and the two orders differ
        assert not np.array_equal(out[0], ref.dot_f16(w, xr, 1))


@pytest.mark.parametrize("n_acc", [1, 4])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_attention_dot_products_follow_ggml(n_acc, dtype):
    """Attention over one key gives that key's value; over several, the output is the f16-rounded
    softmax times V summed in the same lane order as the reference dot product."""
    from edgellm.kernels.cpu.backend import CPUBackend

    b = CPUBackend(threads=2)
    n_kv, hd, used = 1, 64, 40
    kv = b.kv_layer(64, n_kv, hd, hd, dtype)
    k = RNG.standard_normal((used, n_kv, hd)).astype(np.float32)
    v = RNG.standard_normal((used, n_kv, hd)).astype(np.float32)
    b.kv_store(kv, k, v, np.arange(used))
    q = RNG.standard_normal((1, 1, hd)).astype(np.float32) * 3
    out = np.empty((1, hd), np.float32)
    n_tok = 1 if n_acc == 4 else 2
    qq = np.repeat(q, n_tok, axis=0)
    pos = np.arange(used - n_tok, used) if n_tok == 2 else np.array([used - 1])
    out = np.empty((n_tok, hd), np.float32)
    b.attention(qq, kv, pos, 0.125, out)
    # the reference: scores in the lane order, ggml's exp and float64 sum, probabilities rounded
    kc = kv.k[:used, 0]
    qr = q[0, 0].astype(dtype).astype(np.float32)
    s = (ref.dot_f16(kc, qr, n_acc) * np.float32(0.125)).astype(np.float32)
    from edgellm.kernels.cpu.numpy_backend import expf_ggml

    e = expf_ggml(s - s.max())
    pad = np.zeros((-len(e)) % 8, np.float32)
    chunks = ref.hsum8(np.concatenate([e, pad]).reshape(-1, 8))
    p = (e * np.float32(1.0 / chunks.astype(np.float64).sum())).astype(dtype).astype(np.float32)
    vt = np.ascontiguousarray(kv.v[:used, 0].T)  # (hd, used): rows of V^T, as ggml multiplies them
    pad_v = np.zeros((hd, (-used) % (8 * n_acc)), vt.dtype)
    expect = ref.dot_f16(np.concatenate([vt, pad_v], 1), np.concatenate([p, np.zeros(pad_v.shape[1], np.float32)]),
                         n_acc)
    np.testing.assert_array_equal(out[-1], expect)


@pytest.mark.parametrize("n_head, n_kv, hd, window, n_tok, n_past", [
    (9, 3, 64, 0, 37, 0), (4, 1, 256, 0, 20, 0), (4, 1, 256, 12, 30, 0), (9, 3, 64, 0, 13, 20),
    (4, 2, 64, 16, 13, 30), (8, 1, 64, 0, 21, 3), (5, 1, 64, 0, 9, 0)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_batch_attention_equals_the_per_query_kernel(n_head, n_kv, hd, window, n_tok, n_past, dtype):
    """attend_batch (V transposed, four keys and four rows of V^T at a time, visible ranges per
    token) returns attend_ggml's tinyBLAS-order result bit for bit: causal batches, a prefix
    already in the cache, sliding windows over a ring cache, f16 and f32 caches."""
    from edgellm.kernels.cpu.backend import CPUBackend

    b = CPUBackend(threads=2)
    size = n_tok + n_past if not window else min(n_tok + n_past, window + n_tok)
    kv = b.kv_layer(size, n_kv, hd, hd, dtype, window)
    if n_past:
        b.kv_store(kv, RNG.standard_normal((n_past, n_kv, hd)).astype(np.float32),
                   RNG.standard_normal((n_past, n_kv, hd)).astype(np.float32), np.arange(n_past))
    pos = np.arange(n_past, n_past + n_tok)
    b.kv_store(kv, RNG.standard_normal((n_tok, n_kv, hd)).astype(np.float32),
               RNG.standard_normal((n_tok, n_kv, hd)).astype(np.float32), pos)
    q = (RNG.standard_normal((n_tok, n_head, hd)) * 3).astype(np.float32)
    out = np.empty((n_tok, n_head * hd), np.float32)
    b.attention(q, kv, pos, 0.125, out)
    kc, vc = kv.kernel_arrays()
    expect = np.empty_like(out)
    used = kv.n_used
    kmap, kbeg, kend = np.arange(used), np.zeros(n_tok, np.int64), np.full(n_tok, used, np.int64)
    b.attn_kernels.attend_ggml(q, kc, vc, kv.pos, kmap, kbeg, kend, pos, kv.window, np.float32(0.125), 1, expect,
                      kc.dtype.type(0))
    np.testing.assert_array_equal(out, expect)


def _attention_reference(qh, keys, values, visible, dtype, n_acc, scale=np.float32(0.125)):
    """One head of one token over its key list (rows of keys / values as the cache holds them; a key
    not visible scores -inf): ggml's order, as in test_attention_dot_products_follow_ggml."""
    from edgellm.kernels.cpu.numpy_backend import expf_ggml

    kf = keys.astype(np.float32)
    qr = qh.astype(dtype).astype(np.float32)
    s = (ref.dot_f16(kf, qr, n_acc) * scale).astype(np.float32)
    e = np.where(visible, expf_ggml(s - s[visible].max()), np.float32(0))
    pad = np.zeros((-len(e)) % 8, np.float32)
    p = (e * np.float32(1.0 / ref.hsum8(np.concatenate([e, pad]).reshape(-1, 8)).astype(np.float64).sum()))
    p = p.astype(dtype).astype(np.float32)
    vt = np.ascontiguousarray(values.astype(np.float32).T)
    pad_v = np.zeros((vt.shape[0], (-len(p)) % (8 * n_acc)), np.float32)
    return ref.dot_f16(np.concatenate([vt, pad_v], 1), np.concatenate([p, np.zeros(pad_v.shape[1], np.float32)]),
                       n_acc)


@pytest.mark.parametrize("n_head, n_kv, hd, n_seq, window", [
    (9, 3, 64, 1, 0), (9, 3, 64, 2, 0), (9, 3, 64, 8, 0), (4, 1, 256, 1, 0), (4, 1, 256, 4, 24),
    (32, 8, 64, 1, 0), (32, 8, 64, 3, 0), (8, 2, 64, 5, 16), (12, 2, 128, 1, 0), (24, 8, 128, 2, 0),
    (16, 2, 64, 1, 12), (32, 4, 64, 1, 0)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("kernel", ["attend_ggml", "attend_decode"])
def test_decode_attention_of_many_sequences_follows_ggml_per_head(n_head, n_kv, hd, n_seq, window, dtype, kernel):
    """Decode attention (vec_dot_f16's four accumulators) for n sequences at once, each token over
    its own keys scattered over a shared pool of slots: every head of every token equals the NumPy
    reference bit for bit, for attend_ggml (head by head) and attend_decode (the heads of a KV
    head together: 3, 4, 6, 8 of them, in passes of attention.DECODE_HEADS; split when there are few
    KV heads)."""
    from edgellm.kernels.cpu import attention

    n_slots = 64 * n_seq + 16
    zero = np.float16(0).view(np.uint16) if dtype == np.float16 else np.float32(0)
    kc = RNG.standard_normal((n_slots, n_kv, hd)).astype(dtype)
    vc = RNG.standard_normal((n_slots, n_kv, hd)).astype(dtype)
    kpos = np.full(n_slots, -1, np.int32)
    slots = RNG.permutation(n_slots)
    lens = RNG.integers(1, 60, size=n_seq)
    kmap, kbeg, kend, at = [], [], [], 0
    for t in range(n_seq):
        mine = slots[at:at + lens[t]]
        at += lens[t]
        kpos[mine] = np.arange(lens[t])
        kbeg.append(len(kmap))
        kmap.extend(mine)
        kend.append(len(kmap))
    kmap, kbeg, kend = np.array(kmap, np.int64), np.array(kbeg, np.int64), np.array(kend, np.int64)
    pos = (lens - 1).astype(np.int32)
    q = (RNG.standard_normal((n_seq, n_head, hd)) * 3).astype(np.float32)
    out = np.full((n_seq, n_head * hd), np.nan, np.float32)
    k_arg = kc.view(np.uint16) if dtype == np.float16 else kc
    v_arg = vc.view(np.uint16) if dtype == np.float16 else vc
    if kernel == "attend_ggml":
        attention.attend_ggml(q, k_arg, v_arg, kpos, kmap, kbeg, kend, pos, window, np.float32(0.125), 4, out, zero)
    else:
        attention.attend_decode(q, k_arg, v_arg, kpos, kmap, kbeg, kend, pos, window, np.float32(0.125), out, zero)
    g = n_head // n_kv
    for t in range(n_seq):
        mine = kmap[kbeg[t]:kend[t]]
        visible = (pos[t] - kpos[mine] < window) if window else np.ones(len(mine), bool)
        for h in range(n_head):
            expect = _attention_reference(q[t, h], kc[mine, h // g], vc[mine, h // g], visible, dtype, 4)
            np.testing.assert_array_equal(out[t, h * hd:(h + 1) * hd], expect, err_msg=f"token {t} head {h}")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_decode_attention_with_heads_whose_probabilities_underflow(dtype):
    """One head of each KV head with a query 300x larger: most of its probabilities are exactly 0
    while its neighbours' are not, so attend_decode's value sum takes its per-head path for those
    keys; every output equals attend_ggml's (head by head, checked against NumPy above) bit for bit,
    and the peaked heads did have zero probabilities to skip."""
    from edgellm.kernels.cpu import attention

    n_head, n_kv, hd, n_keys = 8, 2, 64, 300
    kc = RNG.standard_normal((n_keys, n_kv, hd)).astype(dtype)
    vc = RNG.standard_normal((n_keys, n_kv, hd)).astype(dtype)
    kpos = np.arange(n_keys, dtype=np.int32)
    kmap = np.arange(n_keys, dtype=np.int64)
    kbeg, kend = np.array([0], np.int64), np.array([n_keys], np.int64)
    pos = np.array([n_keys - 1], np.int32)
    q = RNG.standard_normal((1, n_head, hd)).astype(np.float32)
    q[0, ::4] *= 300
    zero = np.float16(0).view(np.uint16) if dtype == np.float16 else np.float32(0)
    k_arg = kc.view(np.uint16) if dtype == np.float16 else kc
    v_arg = vc.view(np.uint16) if dtype == np.float16 else vc
    expect = np.full((1, n_head * hd), np.nan, np.float32)
    got = expect.copy()
    attention.attend_ggml(q, k_arg, v_arg, kpos, kmap, kbeg, kend, pos, 0, np.float32(0.125), 4, expect, zero)
    attention.attend_decode(q, k_arg, v_arg, kpos, kmap, kbeg, kend, pos, 0, np.float32(0.125), got, zero)
    np.testing.assert_array_equal(got, expect)
    scores = np.einsum("d,kd->k", q[0, 0], kc[:, 0].astype(np.float32)) * 0.125
    assert (scores.max() - scores > 110).sum() > n_keys // 2  # exp of these is 0 in float32


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("window", [0, 8])
def test_quantized_cache_attention_is_ggml_flash_attention_bit_for_bit(kind, window):
    """A q8_0 / q4_0 cache is read as llama.cpp's CPU flash attention reads it (the query as Q8_0
    blocks, integer block dot products, an online softmax): flash.attend_flash_quant (CPUBackend)
    equals reference.flash_attn_quant (NumpyBackend, head by head) bit for bit; two sequences on a
    paged cache, a prompt then a ragged step, GQA 2, hd_k 64 != hd_v 32, a sliding window."""
    from types import SimpleNamespace

    from edgellm.kernels.cpu.backend import CPUBackend
    from edgellm.kernels.cpu.numpy_backend import NumpyBackend
    from edgellm.kv_cache import KVCache
    from paged import attention_step

    cfg = SimpleNamespace(n_layer=1, n_head_kv=2, head_dim_k=64, head_dim_v=32, sliding_window=window,
                          swa_layers=[window > 0])
    n_head = 4
    backends = {"numba": CPUBackend(threads=2), "numpy": NumpyBackend()}
    caches = {d: KVCache(cfg, [b], n_ctx=48, n_batch=32, n_seq=2, kv_type=kind) for d, b in backends.items()}
    seqs = {d: (c.new_sequence(), c.new_sequence()) for d, c in caches.items()}
    rng = np.random.default_rng(5)
    for step in ([(0, 21)], [(0, 1), (1, 5)], [(0, 1), (1, 1)]):
        n_tok = sum(n for _, n in step)
        k = (rng.standard_normal((n_tok, 2, 64)) * 2).astype(np.float32)
        v = rng.standard_normal((n_tok, 2, 32)).astype(np.float32)
        q = (rng.standard_normal((n_tok, n_head, 64)) * 3).astype(np.float32)
        outs = {}
        for d, cache in caches.items():
            out = np.full((n_tok, n_head * 32), np.nan, np.float32)
            attention_step(backends[d], cache, seqs[d], step, k, v, q, 0.125, out)
            outs[d] = out
        np.testing.assert_array_equal(caches["numba"].layers[0].k, caches["numpy"].layers[0].k)
        assert np.isfinite(outs["numpy"]).all()
        np.testing.assert_array_equal(outs["numba"], outs["numpy"], err_msg=f"{kind} step {step}")
