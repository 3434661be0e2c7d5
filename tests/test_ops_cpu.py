"""The Numba ops of CPUBackend against their NumPy twins (NumpyBackend) on random inputs and odd
shapes: head_dim 64 / 256, 1..3 KV heads, GQA, sliding windows, a wrapped ring cache, f16 and f32
caches; plus the fused ops against the primitive sequence they replace."""
from __future__ import annotations

import numpy as np
import pytest

from edgellm.backend import qkv_attention_by_ops
from edgellm.kernels.cpu.backend import CPUBackend
from edgellm.kernels.cpu.numpy_backend import NumpyBackend, rope_cache

F32 = np.float32
RNG = np.random.default_rng(2024)
FAST, TWIN = CPUBackend(), NumpyBackend()


def randn(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(F32)


@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 4, 64), (2, 1, 256), (5, 3)])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(shape, weighted):
    x = randn(*shape, scale=3.0)
    w = randn(shape[-1]) if weighted else None
    fast, twin = np.empty_like(x), np.empty_like(x)
    FAST.rms_norm(x, w, 1e-6, fast)
    TWIN.rms_norm(x, w, 1e-6, twin)
    np.testing.assert_allclose(fast, twin, rtol=2e-7, atol=0)
    if not weighted:  # unit root mean square, whatever the input scale
        np.testing.assert_allclose(np.sqrt((fast.astype(np.float64) ** 2).mean(-1)), 1.0, rtol=1e-5)
    inplace = x.copy()
    FAST.rms_norm(inplace, w, 1e-6, inplace)
    np.testing.assert_array_equal(inplace, fast)


def test_add_rms_norm_is_post_norm_residual_then_norm():
    x, o = randn(3, 640), randn(3, 640, scale=5.0)
    post, nxt = randn(640), randn(640)
    x_fast, o_fast, h_fast = x.copy(), o.copy(), np.empty_like(x)
    FAST.add_rms_norm(x_fast, o_fast, post, nxt, 1e-6, h_fast)
    o_twin, h_twin = np.empty_like(o), np.empty_like(x)
    TWIN.rms_norm(o, post, 1e-6, o_twin)
    x_twin = x + o_twin
    TWIN.rms_norm(x_twin, nxt, 1e-6, h_twin)
    np.testing.assert_allclose(x_fast, x_twin, rtol=2e-7, atol=1e-7)
    np.testing.assert_allclose(h_fast, h_twin, rtol=2e-6, atol=1e-6)
    # without norms it is the plain residual add, and h is untouched
    x2, h2 = x.copy(), np.full_like(x, 7.0)
    FAST.add_rms_norm(x2, o.copy(), None, None, 1e-6, h2)
    np.testing.assert_array_equal(x2, x + o)
    assert (h2 == 7.0).all()


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot,hd,base,scale", [(64, 64, 10000.0, 1.0), (32, 64, 500.0, 0.25),
                                                  (256, 256, 1e6, 0.125)])
def test_rope(neox, n_rot, hd, base, scale):
    x = randn(6, 3, hd)
    pos = np.array([0, 1, 7, 100, 2047, 5000], dtype=np.int64)
    fast, twin = x.copy(), x.copy()
    FAST.rope(fast, pos, n_rot, base, scale, neox)
    TWIN.rope(twin, pos, n_rot, base, scale, neox)
    np.testing.assert_array_equal(fast, twin)  # same table, same float32 operations
    np.testing.assert_array_equal(fast[..., n_rot:], x[..., n_rot:])
    np.testing.assert_array_equal(fast[0], x[0])  # position 0: cos 1, sin 0
    np.testing.assert_allclose(np.linalg.norm(fast, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def test_rope_table_rows_equal_the_per_batch_cache():
    pos = np.array([3, 999, 4096, 17], dtype=np.int64)
    cos, sin = FAST.rope_tables.get(64, 10000.0, 0.5, int(pos.max()) + 1)
    c, s = rope_cache(pos, 64, 10000.0, 0.5)
    np.testing.assert_array_equal(cos[pos], c)
    np.testing.assert_array_equal(sin[pos], s)
    assert cos.shape[0] >= 4097


@pytest.mark.parametrize("shape", [(1, 1536), (9, 2048), (2, 5)])
def test_activations(shape):
    gate, up = randn(*shape, scale=4.0), randn(*shape)
    gate[0, :3] = [-100.0, 100.0, 0.0]  # exp overflow: silu -> 0 / x
    fast, twin = np.empty_like(gate), np.empty_like(gate)
    FAST.gelu_mul(gate, up, fast)
    TWIN.gelu_mul(gate, up, twin)
    np.testing.assert_array_equal(fast, twin)  # the same table, the same rounding of gate to f16
    assert fast[0, 0] == 0.0 and fast[0, 1] == gate[0, 1] * up[0, 1]  # below -10 / above 10
    for op, atol in (("silu_mul", 1e-7),):
        fast, twin = np.empty_like(gate), np.empty_like(gate)
        getattr(FAST.ops, op)(gate, up, fast)  # the kernel (the backend may pick the twin)
        getattr(TWIN, op)(gate, up, twin)
        np.testing.assert_allclose(fast, twin, rtol=3e-6, atol=atol, err_msg=op)
    out = np.empty((1, 3), F32)
    FAST.silu_mul(np.array([[0.0, 1.0, -1.0]], F32), np.ones((1, 3), F32), out)
    np.testing.assert_allclose(out[0], [0.0, 0.7310585786, -0.2689414214], rtol=1e-6)


def test_silu_takes_ggml_exp_bit_for_bit():
    """SiLU's full groups of 8 (eight lanes at a time in the kernel) are g / (1 + expf_ggml(-g)) * up
    to the bit, overflow and underflow included; the tail of a row takes the C library's expf."""
    from edgellm.kernels.cpu.numpy_backend import expf_ggml

    gate, up = randn(3, 1540, scale=8.0), randn(3, 1540)
    gate[0, :20] = [np.inf, -np.inf, 100, -100, 89, -89, 88.7, -88.7, 1e-30, -1e-30, 0, -0.0, 127, -127,
                    150, -150, 200, -200, 300, -300]
    out = np.empty_like(gate)
    FAST.ops.silu_mul(gate, up, out)
    n8 = 1536
    with np.errstate(over="ignore", invalid="ignore"):
        expect = gate[:, :n8] / (F32(1.0) + expf_ggml(-gate[:, :n8])) * up[:, :n8]
    np.testing.assert_array_equal(out[:, :n8], expect)
    np.testing.assert_allclose(out[:, n8:], gate[:, n8:] / (1 + np.exp(-gate[:, n8:])) * up[:, n8:], rtol=1e-6)


def filled_pair(n_slots, n_kv, hd, hd_v, dtype, window, positions):
    """The same cache contents in a Numba-backend and a twin-backend KVLayer."""
    caches = FAST.kv_layer(n_slots, n_kv, hd, hd_v, dtype, window), TWIN.kv_layer(n_slots, n_kv, hd, hd_v, dtype, window)
    for p in positions:  # one token at a time; the ring wraps when positions reach n_slots
        k, v = randn(1, n_kv, hd), randn(1, n_kv, hd_v)
        for b, kv in zip((FAST, TWIN), caches):
            b.kv_store(kv, k, v, np.array([p]))
    return caches


# (n_head, n_kv, hd, dtype, window, n_slots, n_past, n_tok)
ATTENTION_CASES = [
    (9, 3, 64, np.float16, 0, 64, 40, 1),  # SmolLM2-like decode
    (9, 3, 64, np.float16, 0, 64, 40, 5),  # small batch, Numba loops
    (4, 1, 256, np.float16, 8, 12, 30, 1),  # Gemma-like, window 8, ring wrapped
    (4, 1, 256, np.float16, 8, 24, 0, 16),  # window within a batch, BLAS path
    (6, 2, 64, np.float32, 0, 96, 10, 20),  # f32 cache, BLAS path with history
    (4, 2, 64, np.float16, 16, 20, 24, 16),  # ring wraps inside a BLAS batch
    (3, 3, 32, np.float16, 0, 300, 290, 1),  # no GQA, many keys: the parallel kernel
]


@pytest.mark.parametrize("n_head,n_kv,hd,dtype,window,n_slots,n_past,n_tok", ATTENTION_CASES)
def test_attention(n_head, n_kv, hd, dtype, window, n_slots, n_past, n_tok):
    fast_kv, twin_kv = filled_pair(n_slots, n_kv, hd, hd, dtype, window, range(n_past + n_tok))
    q = randn(n_tok, n_head, hd)
    pos = np.arange(n_past, n_past + n_tok, dtype=np.int64)
    fast = np.empty((n_tok, n_head * hd), F32)
    twin = np.empty_like(fast)
    FAST.attention(q, fast_kv, pos, 0.125, fast)
    TWIN.attention(q, twin_kv, pos, 0.125, twin)
    np.testing.assert_allclose(fast, twin, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("n_head,n_kv,hd,dtype,window,n_slots,n_past,n_tok", ATTENTION_CASES)
def test_soft_capped_attention_matches_its_twin(n_head, n_kv, hd, dtype, window, n_slots, n_past, n_tok):
    """Gemma-2's cap (cap * tanh(score / cap), before the scale) in the decode, per-head and batch
    kernels against the NumPy twin; a cap of 2 changes the answer (scores up to ~10 here)."""
    fast_kv, twin_kv = filled_pair(n_slots, n_kv, hd, hd, dtype, window, range(n_past + n_tok))
    q = randn(n_tok, n_head, hd) * 3
    pos = np.arange(n_past, n_past + n_tok, dtype=np.int64)
    outs = {}
    for cap in (0.0, 2.0):
        fast, twin = CPUBackend(), NumpyBackend()
        fast.set_attn_softcap(cap)
        twin.set_attn_softcap(cap)
        outs[cap] = [np.empty((n_tok, n_head * hd), F32) for _ in range(2)]
        fast.attention(q, fast_kv, pos, 0.125, outs[cap][0])
        twin.attention(q, twin_kv, pos, 0.125, outs[cap][1])
        np.testing.assert_allclose(outs[cap][0], outs[cap][1], rtol=1e-4, atol=2e-5)
    assert np.abs(outs[2.0][0] - outs[0.0][0]).max() > 1e-3


def test_attention_window_one_returns_own_value():
    kv, _ = filled_pair(8, 1, 64, 64, np.float16, 1, range(6))
    q = randn(2, 2, 64)
    out = np.empty((2, 128), F32)
    FAST.attention(q, kv, np.array([4, 5]), 1.0, out)
    own = kv.v[[4, 5], 0].astype(F32)
    np.testing.assert_allclose(out.reshape(2, 2, 64), np.stack([own, own], axis=1), rtol=1e-6)


@pytest.mark.parametrize("n_tok", [1, 3, 17])
@pytest.mark.parametrize("neox,qk_norm,bias,dtype", [(False, False, True, np.float16), (True, True, False, np.float16),
                                                     (True, True, True, np.float32)])
def test_qkv_attention_fused_equals_primitive_ops(n_tok, neox, qk_norm, bias, dtype):
    n_head, n_kv, hd = 4, 2, 64
    window, n_slots, n_past = (8, 8 + 17, 13) if neox else (0, 64, 13)
    fast_kv, twin_kv = filled_pair(n_slots, n_kv, hd, hd, dtype, window, range(n_past))
    q, k, v = randn(n_tok, n_head, hd), randn(n_tok, n_kv, hd), randn(n_tok, n_kv, hd)
    biases = (randn(n_head * hd), randn(n_kv * hd), randn(n_kv * hd)) if bias else (None, None, None)
    norms = dict(q_norm=randn(hd), k_norm=randn(hd)) if qk_norm else dict(q_norm=None, k_norm=None)
    pos = np.arange(n_past, n_past + n_tok, dtype=np.int64)
    args = dict(biases=biases, eps=1e-6, n_rot=hd, freq_base=10000.0, freq_scale=1.0, neox=neox, pos=pos,
                scale=0.125, **norms)
    fast, twin = np.empty((n_tok, n_head * hd), F32), np.empty((n_tok, n_head * hd), F32)
    FAST.qkv_attention(q.copy(), k.copy(), v.copy(), kv=fast_kv, out=fast, **args)
    qkv_attention_by_ops(TWIN, q.copy(), k.copy(), v.copy(), kv=twin_kv, out=twin, **args)
    np.testing.assert_allclose(fast, twin, rtol=1e-4, atol=2e-5)
    # the cache got the same (rounded) keys and values, at the same slots
    np.testing.assert_array_equal(fast_kv.pos, twin_kv.pos)
    assert fast_kv.n_used == twin_kv.n_used
    np.testing.assert_allclose(fast_kv.k.astype(F32), twin_kv.k.astype(F32), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(fast_kv.v, twin_kv.v)  # v goes in untouched: rounding is exact


def test_q_scale_scales_q_before_it_is_rounded_to_f16():
    """q_scale (Gemma: llama.cpp's graph scales q, not the scores) multiplies q after RoPE, so q
    is rounded to f16 after scaling: with small q the scaled values are f16 subnormals and the
    result differs from scaling the scores; the fused op and the primitive ops agree on it."""
    n_head, n_kv, hd = 2, 1, 64
    q, k, v = randn(1, n_head, hd) * F32(2e-3), randn(1, n_kv, hd), randn(1, n_kv, hd)
    pos = np.array([5], dtype=np.int64)
    base = dict(biases=(None, None, None), q_norm=None, k_norm=None, eps=1e-6, n_rot=hd, freq_base=10000.0,
                freq_scale=1.0, neox=True, pos=pos)
    outs = {}
    for name, scales in (("q", dict(q_scale=0.0625, scale=1.0)), ("scores", dict(q_scale=1.0, scale=0.0625))):
        fast_kv, twin_kv = filled_pair(16, n_kv, hd, hd, np.float16, 0, range(5))
        fast, twin = np.empty((1, n_head * hd), F32), np.empty((1, n_head * hd), F32)
        FAST.qkv_attention(q.copy(), k.copy(), v.copy(), kv=fast_kv, out=fast, **base, **scales)
        qkv_attention_by_ops(TWIN, q.copy(), k.copy(), v.copy(), kv=twin_kv, out=twin, **base, **scales)
        np.testing.assert_allclose(fast, twin, rtol=1e-4, atol=2e-5)
        outs[name] = fast
    assert not np.array_equal(outs["q"], outs["scores"])


def test_f16_cache_conversion_is_exact():
    """The kernels' half <-> float conversions equal NumPy's on every f16 value (nearest even)."""
    kv = FAST.kv_layer(4, 1, 8, 8, np.float16)
    bits = np.arange(65536, dtype=np.uint16).reshape(-1, 1, 8)
    finite = np.isfinite(bits.view(np.float16)).all(axis=(1, 2))
    src = bits[finite]
    out = np.empty((src.shape[0], 1, 8), F32)
    FAST.ops.cache_to_f32(src, out)
    np.testing.assert_array_equal(out[:, 0], src[:, 0].view(np.float16).astype(F32))
    x = np.concatenate([randn(4000, scale=1e-5), randn(4000, scale=10.0), randn(4000, scale=3e4)])
    x = x.reshape(-1, 1, 8)
    rounded = np.empty_like(x)
    FAST.ops.round_to_cache(x, kv.kernel_arrays()[0], rounded)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(rounded, x.astype(np.float16).astype(F32))


_ATTEND_IN_A_PROCESS = """
import sys
import numpy as np
from edgellm.kernels.cpu import attention
rng = np.random.default_rng(0)
kc = rng.standard_normal((64, 2, 64)).astype(np.float16).view(np.uint16)
vc = rng.standard_normal((64, 2, 64)).astype(np.float16).view(np.uint16)
q = rng.standard_normal((1, 4, 64)).astype(np.float32)
kpos = np.full(64, -1, np.int64)
kpos[:20] = np.arange(20)
out = np.empty((1, 256), np.float32)
getattr(attention, sys.argv[1])(q, kc, vc, kpos, np.arange(64, dtype=np.int64), np.array([0]), np.array([20]),
                          np.array([19]), 0, np.float32(0.125), out, kc[0, 0, 0])
print(out.astype(np.float64).sum().hex())
"""


def test_cached_attention_kernels_load_in_any_compile_order(tmp_path):
    """The decode attention compiled by one process (as the fused step compiles it), the unfused
    step's entry to it by a second, both loaded from the disk cache by a third: the third gets the
    same numbers. When the entry called the first as a cached kernel of its own, the third process
    crashed (a segfault: Numba's cache named the callee's parallel part differently in the two
    compiling processes)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    results = []
    for kernel in ("attend_decode", "attend_ggml_decode", "attend_ggml_decode"):
        r = subprocess.run([sys.executable, "-c", _ATTEND_IN_A_PROCESS, kernel], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, (kernel, r.returncode, r.stderr[-2000:])
        results.append(r.stdout.strip())
    assert len(set(results)) == 1 and results[0].startswith(("0x", "-0x")), results
    assert any((tmp_path / "numba").rglob("*attend_decode*.nbc"))  # the cache was written and read
