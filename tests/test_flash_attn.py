"""llama.cpp's CPU flash attention over an f16 cache (load(..., flash_attn="on")): the Numba kernel
ops.attend_flash_f16 against its NumPy twin reference.flash_attn_f16, bit for bit, for each of
ggml's three kernels (one-chunk, tiled, split-KV), with masked, empty and sliding-window keys."""
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
    from edgellm.kernels.cpu import ops
    from edgellm.kernels.cpu import reference as ref

    rng = np.random.default_rng(n_keys * 31 + n_tok)
    n_head, n_kv = 4, 2
    q, kc, vc, kpos, kmap, kbeg, kend, pos = _case(rng, n_keys, n_tok, n_head, n_kv, hd, hdv, window,
                                                   holes=n_keys % 2 == 0)
    n_cells = ref.flash_cells(n_keys)
    if kernel == "split":
        assert ref.flash_kernel(1, n_cells) == "split"
    scale = F32(1 / np.sqrt(hd))
    kinds = {"one_chunk": ops.FA_ONE_CHUNK, "tiled": ops.FA_TILED, "split": ops.FA_SPLIT}
    got = np.full((n_tok, n_head * hdv), np.nan, F32)
    ops.attend_flash_f16(q, kc.view(np.uint16), vc.view(np.uint16), kpos, kmap, kbeg, kend, pos, window, scale,
                         np.full(n_tok, kinds[kernel], np.int64), np.full(n_tok, n_cells, np.int64), n_split, got)
    expect = _reference(q, kc, vc, kpos, pos, window, scale, kernel, n_cells, n_split)
    assert np.isfinite(expect).all()
    np.testing.assert_array_equal(got, expect)
