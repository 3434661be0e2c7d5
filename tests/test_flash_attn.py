"""llama.cpp's CPU flash attention over an f16 cache (load(..., flash_attn="on")): the Numba kernel
flash.attend_flash_f16 against its NumPy twin reference.flash_attn_f16, bit for bit, for each of
ggml's three kernels (one-chunk, tiled, split-KV), with masked, empty and sliding-window keys
(flash.attend_flash_f16_tiled takes the tiled rows, by q tiles of 64: 100 rows make a tile of 36)."""
from __future__ import annotations

import numpy as np
import pytest

F32 = np.float32


def _case(rng, n_keys, n_tok, n_head, n_kv, hd, hdv, window, holes):
    """A one-sequence cache of n_keys cells (kpos = cell, some left empty) and n_tok queries at the
    last positions; keys with a large spread so that new maxima and underflows both occur."""
    kc = (rng.standard_normal((n_keys, n_kv, hd)) * 2).astype(np.float16)
    vc = (rng.standard_normal((n_keys, n_kv, hdv)) * 3).astype(np.float16)
    kpos = np.arange(n_keys, dtype=np.int64)
    if holes:
        kpos[rng.random(n_keys) < 0.1] = -1
    q = (rng.standard_normal((n_tok, n_head, hd)) * 4).astype(F32)
    q[:, ::3] *= 20  # peaked rows
    pos = np.arange(n_keys - n_tok, n_keys, dtype=np.int64)
    kmap = np.arange(n_keys, dtype=np.int64)
    kbeg = np.zeros(n_tok, np.int64)
    kend = np.full(n_tok, n_keys, np.int64)
    return q, kc, vc, kpos, kmap, kbeg, kend, pos


def _reference(q, kc, vc, kpos, pos, window, scale, kernel, n_cells, n_split):
    from edgellm.kernels.cpu import reference as ref

    n_tok, n_head, _ = q.shape
    g = n_head // kc.shape[1]
    hdv = vc.shape[2]
    out = np.empty((n_tok, n_head * hdv), F32)
    for t in range(n_tok):
        p = pos[t]
        vis = (kpos >= 0) & (kpos <= p) & ((window <= 0) | (p - kpos < window))
        for h in range(n_head):
            out[t, h * hdv:(h + 1) * hdv] = ref.flash_attn_f16(
                q[t, h], kc[vis, h // g], vc[vis, h // g], kpos[vis], scale, kernel, n_cells, n_split)
    return out


@pytest.mark.parametrize("kernel,n_keys,n_tok,hd,hdv,window,n_split", [
    ("one_chunk", 40, 1, 64, 64, 0, 1),
    ("one_chunk", 300, 1, 128, 96, 0, 1),
    ("one_chunk", 90, 7, 32, 64, 16, 1),
    ("one_chunk", 200, 63, 64, 64, 0, 1),
    ("tiled", 150, 64, 64, 64, 0, 1),
    ("tiled", 260, 100, 256, 256, 48, 1),
    ("tiled", 70, 70, 32, 40, 0, 1),
    ("split", 300, 1, 64, 64, 0, 2),
    ("split", 700, 1, 128, 128, 0, 3),
    ("split", 520, 1, 64, 32, 100, 4),
])
def test_flash_f16_kernel_equals_reference(kernel, n_keys, n_tok, hd, hdv, window, n_split):
    from edgellm.kernels.cpu import flash
    from edgellm.kernels.cpu import reference as ref

    rng = np.random.default_rng(n_keys * 31 + n_tok)
    n_head, n_kv = 4, 2
    q, kc, vc, kpos, kmap, kbeg, kend, pos = _case(rng, n_keys, n_tok, n_head, n_kv, hd, hdv, window,
                                                   holes=n_keys % 2 == 0)
    n_cells = ref.flash_cells(n_keys)
    if kernel == "split":
        assert ref.flash_kernel(1, n_cells) == "split"
    scale = F32(1 / np.sqrt(hd))
    kinds = {"one_chunk": flash.FA_ONE_CHUNK, "tiled": flash.FA_TILED, "split": flash.FA_SPLIT}
    got = np.full((n_tok, n_head * hdv), np.nan, F32)
    if kernel == "tiled":
        flash.attend_flash_f16_tiled(q, kc.view(np.uint16), vc.view(np.uint16), kpos, kmap, 0, n_keys, pos, window,
                                   scale, got)
    else:
        flash.attend_flash_f16(q, kc.view(np.uint16), vc.view(np.uint16), kpos, kmap, kbeg, kend, pos, window, scale,
                             np.full(n_tok, kinds[kernel], np.int64), np.full(n_tok, n_cells, np.int64), n_split,
                             got)
    expect = _reference(q, kc, vc, kpos, pos, window, scale, kernel, n_cells, n_split)
    assert np.isfinite(expect).all()
    np.testing.assert_array_equal(got, expect)


def test_the_three_kernels_differ():
    """The tests above can tell the kernels apart: on the same row the one-chunk, tiled and
    split-KV kernels (and ggml's non-flash order) give different bits."""
    from edgellm.kernels.cpu import reference as ref

    rng = np.random.default_rng(3)
    q, kc, vc, kpos, *_ = _case(rng, 400, 1, 2, 1, 64, 64, 0, holes=False)
    outs = {k: ref.flash_attn_f16(q[0, 0], kc[:, 0], vc[:, 0], kpos, F32(0.125), k, 512, 3)
            for k in ("one_chunk", "tiled", "split")}
    assert not np.array_equal(outs["one_chunk"], outs["tiled"])
    assert not np.array_equal(outs["one_chunk"], outs["split"])
    assert not np.array_equal(outs["tiled"], outs["split"])
    assert ref.flash_kernel(1, 256) == "one_chunk" and ref.flash_kernel(1, 512) == "split"
    assert ref.flash_kernel(63, 1024) == "one_chunk" and ref.flash_kernel(64, 256) == "tiled"
    assert [ref.flash_cells(n) for n in (1, 256, 257, 600)] == [256, 256, 512, 768]


@pytest.mark.parametrize("window", [0, 40])
def test_backends_flash_attention_on_a_paged_cache(window):
    """CPUBackend(flash_attn=True) (flash.attend_flash_f16) equals NumpyBackend(flash_attn=True)
    (reference.flash_attn_f16 head by head) bit for bit on a paged f16 cache: two sequences, a
    70-token prompt (tiled), a ragged step (5 tokens: one-chunk; a decode token), decode tokens
    past 256 cached cells (split-KV into `threads` = 2 ranges), GQA 2, a sliding window."""
    from types import SimpleNamespace

    from edgellm.kernels.cpu.backend import CPUBackend
    from edgellm.kernels.cpu.numpy_backend import NumpyBackend
    from edgellm.kv_cache import KVCache
    from paged import attention_step

    cfg = SimpleNamespace(n_layer=1, n_head_kv=2, head_dim_k=64, head_dim_v=64, sliding_window=window,
                          swa_layers=[window > 0])
    n_head = 4
    backends = {"numba": CPUBackend(threads=2, flash_attn=True), "numpy": NumpyBackend(threads=2, flash_attn=True)}
    caches = {d: KVCache(cfg, [b], n_ctx=320, n_batch=256, n_seq=2, kv_type="f16") for d, b in backends.items()}
    seqs = {d: (c.new_sequence(), c.new_sequence()) for d, c in caches.items()}
    rng = np.random.default_rng(7)
    steps = [[(0, 70)], [(0, 1), (1, 5)], [(0, 200)], [(0, 1), (1, 1)], [(0, 1)]]
    for step in steps:
        n_tok = sum(n for _, n in step)
        k = (rng.standard_normal((n_tok, 2, 64)) * 2).astype(F32)
        v = rng.standard_normal((n_tok, 2, 64)).astype(F32)
        q = (rng.standard_normal((n_tok, n_head, 64)) * 3).astype(F32)
        outs = {}
        for d, cache in caches.items():
            out = np.full((n_tok, n_head * 64), np.nan, F32)
            attention_step(backends[d], cache, seqs[d], step, k, v, q, 0.125, out)
            outs[d] = out
        assert np.isfinite(outs["numpy"]).all()
        np.testing.assert_array_equal(outs["numba"], outs["numpy"], err_msg=f"step {step}")
    assert seqs["numba"][0].n_past == 273  # the last decodes saw 512 cells: split-KV


def test_flash_attn_argument():
    from edgellm.api import flash_attn_arg
    from edgellm.errors import EdgeLLMError

    assert [flash_attn_arg(v) for v in ("on", "off", "auto", "ON", True, False)] == [True, False, True, True,
                                                                                     True, False]
    with pytest.raises(EdgeLLMError, match="flash_attn"):
        flash_attn_arg("yes")
    with pytest.raises(EdgeLLMError, match="flash_attn"):
        flash_attn_arg(1)


def test_flash_attn_load_checks(smollm2_path):
    """f32 cache with flash attention: a clear error; with it on, the fused decode kernel (which
    reads the cache in the non-flash order) declines, so the unfused ops run."""
    import edgellm
    from edgellm.errors import EdgeLLMError

    with pytest.raises(EdgeLLMError, match="f32"):
        edgellm.load(smollm2_path, n_ctx=64, kv_type="f32", flash_attn="on")
    m = edgellm.load(smollm2_path, n_ctx=64, threads=1, flash_attn="on")
    cpu = m.runtime.backends["cpu"]
    assert cpu.flash_attn
    assert cpu.decode_layers([], None, None, [], None, ropes=[], eps=0, n_rot=0, neox=False, scale=1.0,
                             gelu=False) is False
