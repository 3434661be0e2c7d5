"""The paged KV cache's bookkeeping: blocks, reference counts, prefix reuse, LRU, sliding windows.

These run on a tiny stand-in config and the NumPy backend (no kernels)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from edgellm.kernels.cpu.numpy_backend import NumpyBackend
from edgellm.errors import InvalidArgumentError
from edgellm.kv_cache import (BLOCK_SIZE, BlockPool, KVCache, block_hashes, blocks_per_sequence,
                              build_layouts, kv_bytes_per_token, pool_blocks)


def config(n_layer=2, window=0, swa=()):
    return SimpleNamespace(n_layer=n_layer, n_head_kv=2, head_dim_k=8, head_dim_v=8, sliding_window=window,
                           swa_layers=[il in swa for il in range(n_layer)])


def cache(n_blocks_ctx=4, n_seq=2, kv_size=None, **kw):
    cfg = config(**kw)
    return KVCache(cfg, [NumpyBackend()] * cfg.n_layer, n_ctx=n_blocks_ctx * BLOCK_SIZE, n_batch=BLOCK_SIZE,
                   n_seq=n_seq, kv_size=kv_size)


def test_pool_hands_out_free_blocks_then_evicts_the_least_recently_cached():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2) and pool.allocate() is None and pool.n_used == 3
    pool.register(a, 111)
    pool.register(b, 222)
    pool.release(b)  # cached first
    pool.release(a)
    pool.release(c)  # no hash: straight to the free list
    assert (pool.n_used, pool.n_cached, pool.n_available) == (0, 2, 3)
    assert pool.allocate() == c  # free blocks before cached ones
    assert pool.allocate() == b and pool.lookup(222) is None  # the older cached block goes first
    assert pool.lookup(111) == a
    pool.share(a)  # a cache hit takes it out of the LRU
    assert pool.n_cached == 0 and pool.ref[a] == 1 and pool.allocate() is None


def test_block_hashes_chain_over_the_whole_prefix():
    t = list(range(3 * BLOCK_SIZE + 5))
    h = block_hashes(t)
    assert len(h) == 3
    u = list(t)
    u[0] = 999  # a change in block 0 changes every later block's hash
    assert all(x != y for x, y in zip(h, block_hashes(u)))
    u = list(t)
    u[2 * BLOCK_SIZE] = 999
    assert block_hashes(u)[:2] == h[:2] and block_hashes(u)[2] != h[2]


def fill(seq, tokens):
    assert seq.grow(len(tokens))
    seq.commit(tokens)


def test_prefix_is_shared_and_only_whole_blocks_before_the_last_token_are_reused():
    kv = cache()
    pool = kv.groups[0].pool
    a = kv.new_sequence()
    prompt = list(range(40))  # 2 full blocks + 8
    fill(a, prompt)
    assert pool.n_used == 3
    b = kv.new_sequence()
    assert b.reuse_prefix(prompt + [7, 8]) == 2 * BLOCK_SIZE
    assert b.tables[0] == a.tables[0][:2] and pool.ref[a.tables[0][0]] == 2
    # exactly two blocks long: the last token must be evaluated, so only the first block is reused
    c = kv.new_sequence()
    assert c.reuse_prefix(prompt[:32]) == BLOCK_SIZE
    # the sequences write only into blocks of their own
    assert b.grow(10) and b.tables[0][2] not in a.tables[0]
    a.free()
    b.free()
    c.free()
    assert pool.n_used == 0 and pool.n_cached == 3  # the two full blocks and a's tail stay for reuse
    d = kv.new_sequence()
    assert d.reuse_prefix(prompt[:32] + [1]) == 2 * BLOCK_SIZE  # a later request still finds them


def test_a_different_token_stops_the_reuse_at_its_block():
    kv = cache()
    a = kv.new_sequence()
    fill(a, list(range(64)))
    b = kv.new_sequence()
    other = list(range(64))
    other[20] = 5000  # in block 1
    assert b.reuse_prefix(other) == BLOCK_SIZE


def test_grow_refuses_without_allocating_when_the_pool_is_short():
    kv = cache(n_blocks_ctx=4, n_seq=1)  # 4 blocks
    a, b = kv.new_sequence(), kv.new_sequence()
    assert a.grow(3 * BLOCK_SIZE)
    assert not b.grow(2 * BLOCK_SIZE) and b.tables[0] == []
    assert b.grow(BLOCK_SIZE) and kv.block_counts() == {"total": 4, "used": 4, "cached": 0, "free": 0}


def test_sliding_window_group_gives_back_blocks_out_of_the_window():
    kv = cache(n_blocks_ctx=8, n_seq=1, window=20, swa=(1,))
    full, swa = (kv.groups[0], kv.groups[1]) if kv.groups[0].window == 0 else (kv.groups[1], kv.groups[0])
    assert swa.pool.n_blocks == blocks_per_sequence(20, 8 * BLOCK_SIZE, BLOCK_SIZE) < full.pool.n_blocks
    seq = kv.new_sequence()
    gi = kv.groups.index(swa)
    for i in range(6):  # 96 tokens, one block a step
        fill(seq, list(range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)))
    # a query at 96 sees 77..96; the key list starts at a multiple of 32: position 64, block 4
    assert seq.tables[gi][:4] == [None] * 4 and all(b is not None for b in seq.tables[gi][4:])
    assert all(b is not None for b in seq.tables[kv.groups.index(full)])
    keys = seq.key_slots(gi, 96, 96) if seq.grow(1) else None
    assert len(keys) == 96 + 1 - 64


def test_layouts_put_each_token_on_its_sequence_slots():
    kv = cache()
    a, b = kv.new_sequence(), kv.new_sequence()
    fill(a, list(range(20)))
    assert a.grow(1) and b.grow(5)
    lay = build_layouts(kv, [(a, np.array([20])), (b, np.arange(5))])[0]
    bs = BLOCK_SIZE
    assert lay.n_single == 1 and lay.chunks == [(1, 6)]
    assert lay.slots[0] == a.tables[0][1] * bs + 4
    assert list(lay.slots[1:]) == [b.tables[0][0] * bs + i for i in range(5)]
    keys_a = lay.kmap[lay.kbeg[0]:lay.kend[0]]
    assert len(keys_a) == 21 and keys_a[16] == a.tables[0][1] * bs
    keys_b = lay.kmap[lay.kbeg[3]:lay.kend[3]]
    assert len(keys_b) == 5 and set(keys_b).isdisjoint(keys_a)


def test_bytes_per_token_and_pool_size_are_the_ledger_formula():
    cfg = config()
    assert kv_bytes_per_token(cfg, "f16") == (8 + 8) * 2 * 2
    assert kv_bytes_per_token(cfg, "f32") == (8 + 8) * 2 * 4
    kv = cache(n_blocks_ctx=4, n_seq=3)
    assert kv.groups[0].pool.n_blocks == pool_blocks(0, n_ctx=64, n_batch=16, n_seq=3) == 12
    assert kv.nbytes()["cpu"] == 2 * 12 * BLOCK_SIZE * kv_bytes_per_token(cfg, "f16")
    assert cache(n_blocks_ctx=4, n_seq=3, kv_size=40).groups[0].pool.n_blocks == 4  # at least one context
    with pytest.raises(InvalidArgumentError, match="kv_type"):
        KVCache(cfg, [NumpyBackend()] * 2, n_ctx=64, n_batch=16, n_seq=1, kv_type="q3")


def test_hadamard_rotation_is_orthonormal_and_sized_like_llama_cpp():
    from edgellm.backend import hadamard, rotate, rotation_size

    assert (rotation_size(64, True), rotation_size(256, True), rotation_size(192, True)) == (64, 256, 64)
    assert (rotation_size(256, False), rotation_size(80, True)) == (64, 0)
    h = hadamard(128)
    np.testing.assert_allclose(h @ h, np.eye(128), atol=1e-6)
    x = np.random.default_rng(0).standard_normal((3, 2, 256)).astype(np.float32)
    y = x.copy()
    rotate(y, hadamard(64))
    assert np.abs(y - x).max() > 0.1
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    rotate(y, hadamard(64))
    np.testing.assert_allclose(y, x, atol=1e-5)


def test_a_sequences_partial_last_block_is_copied_for_the_next_turn():
    kv = cache()
    lk = kv.layers[0]
    a = kv.new_sequence()
    turn1 = list(range(40))  # 2 full blocks + 8 tokens
    fill(a, turn1)
    tail_block = a.tables[0][2]
    lk.k[tail_block * BLOCK_SIZE:tail_block * BLOCK_SIZE + 8] = 7.0  # what a step would have written
    kv.groups[0].slot_pos[tail_block * BLOCK_SIZE:tail_block * BLOCK_SIZE + 8] = np.arange(32, 40)
    a.free()
    b = kv.new_sequence()
    assert b.reuse_prefix(turn1 + [100, 101]) == 40  # the whole first turn, not just its 32
    new = b.tables[0][2]
    assert new != tail_block and (lk.k[new * BLOCK_SIZE:new * BLOCK_SIZE + 8] == 7.0).all()
    assert list(kv.groups[0].slot_pos[new * BLOCK_SIZE:new * BLOCK_SIZE + 8]) == list(range(32, 40))
    assert b.tokens == turn1
    # a prompt that differs inside the tail takes only the tokens before the difference
    c = kv.new_sequence()
    other = turn1[:36] + [999, 1000]
    assert c.reuse_prefix(other) == 36
    # the last token is always evaluated
    d = kv.new_sequence()
    assert d.reuse_prefix(turn1) == 39


def test_no_partial_copy_when_sharing_took_the_last_spare_blocks():
    kv = cache(n_blocks_ctx=4, n_seq=1)  # 4 blocks
    a = kv.new_sequence()
    turn1 = list(range(40))  # blocks 0, 1 full; block 2 holds 8 tokens
    fill(a, turn1)
    a.free()  # all three cached, one free
    hog = kv.new_sequence()
    assert hog.grow(1)  # takes the free block: only the three cached ones are left
    b = kv.new_sequence()
    # sharing the two full blocks leaves the tail as the only spare block: nothing to copy it into
    assert b.reuse_prefix(turn1 + [7]) == 32 and len(b.tables[0]) == 2
