"""One attention step on a one-layer paged KV cache, as the engine runs it (shared by the tests that
hold two backends' caches and outputs together)."""
from __future__ import annotations

import numpy as np

from edgellm.kv_cache import build_layouts


def attention_step(backend, cache, seqs, step, k, v, q, scale, out, up=np.ascontiguousarray):
    """step: [(index into seqs, tokens)]: grow those sequences, lay the step out in the cache's one
    layer, store k and v (n_tok, n_kv, hd) and attend q into out with `backend`, then commit the
    tokens. up: the backend's upload (CPU: a contiguous array). Returns the tokens' positions."""
    entries = []
    for i, n in step:
        seq = seqs[i]
        assert seq.grow(n)
        entries.append((seq, np.arange(seq.n_past, seq.n_past + n, dtype=np.int64)))
    lk = cache.layers[0]
    lk.layout = build_layouts(cache, entries)[0]
    pos = np.concatenate([p for _, p in entries])
    backend.kv_store(lk, up(k), up(v), pos)
    backend.attention(up(q), lk, pos, scale, out)
    for (seq, _), (_, n) in zip(entries, step):
        seq.commit(np.zeros(n, np.int64))
    return pos
