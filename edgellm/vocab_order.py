"""The order in which llama.cpp visits its vocabulary's text -> id map.

llama.cpp finds the special tokens a file does not name (EOT, FIM, ...) by walking a
`std::unordered_map<std::string, llama_token>` filled with ids 0..n-1 in order, and keeps the first
match. Where a vocabulary holds two candidates (SmolLM2 and Qwen2.5 both have `<|endoftext|>` and
`<|im_end|>`), the winner is decided by that walk: SmolLM2's EOT is `<|endoftext|>` (id 0), Qwen's
`<|im_end|>` (id 151645). This module reproduces the walk of GCC's libstdc++ (the library of the
Linux builds people run): its string hash, its prime bucket counts, and where a node is linked.

libstdc++'s insertion rule, in list terms: a node whose bucket is empty is linked at the front of
the list; otherwise at the front of its bucket's run. A rehash re-links the old list's nodes one by
one by the same rule. So the list after any sequence of inserts and rehashes is the rule applied to
(the list at the last rehash, then the nodes inserted since): runs ordered by their bucket's first
appearance, latest first, and each run's nodes latest first.
"""
from __future__ import annotations

import numpy as np

_MUL = np.uint64(0xC6A4A7935BD1E995)
_SEED = np.uint64(0xC70F6907)  # std::hash<std::string>'s seed for _Hash_bytes
_S47 = np.uint64(47)

# The bucket count after each rehash of a map filled from empty, one insert at a time: the rehash
# happens when the element count reaches the current count (maximum load factor 1). libstdc++'s
# prime list, the entries such a map meets.
_BUCKETS = (13, 29, 59, 127, 257, 541, 1109, 2357, 5087, 10273, 20753, 42043, 85229, 172933, 351061,
            712697, 1447153)


def _shift_mix(v: np.ndarray) -> np.ndarray:
    return v ^ (v >> _S47)


def string_hashes(blob: bytes, offsets: np.ndarray) -> np.ndarray:
    """libstdc++'s std::hash<std::string> (64-bit _Hash_bytes) of each string: string i is
    blob[offsets[i]:offsets[i + 1]]. uint64 (n,)."""
    data = np.frombuffer(blob + bytes(8), dtype=np.uint8)
    start = np.asarray(offsets[:-1], dtype=np.int64)
    length = np.diff(np.asarray(offsets, dtype=np.int64))
    weights = np.uint64(256) ** np.arange(8, dtype=np.uint64)  # little-endian byte weights
    with np.errstate(over="ignore"):
        h = _SEED ^ (length.astype(np.uint64) * _MUL)
        aligned = length & ~7
        for k in range(0, int(aligned.max(initial=0)), 8):
            rows = np.nonzero(aligned > k)[0]
            word = (data[(start[rows] + k)[:, None] + np.arange(8)].astype(np.uint64) * weights).sum(1)
            h[rows] = (h[rows] ^ (_shift_mix(word * _MUL) * _MUL)) * _MUL
        tail = length & 7
        rows = np.nonzero(tail)[0]
        if len(rows):
            idx = (start[rows] + aligned[rows])[:, None] + np.arange(8)
            keep = np.arange(8) < tail[rows][:, None]
            word = (np.where(keep, data[idx], 0).astype(np.uint64) * weights).sum(1)
            h[rows] = (h[rows] ^ word) * _MUL
        h = _shift_mix(_shift_mix(h) * _MUL)
    return h


def _relink(seq: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """The list order after linking `seq`'s nodes one by one into an empty table (see above)."""
    b = buckets[seq]
    pos = np.arange(len(seq))
    first = np.full(int(b.max()) + 1, len(seq), dtype=np.int64)
    np.minimum.at(first, b, pos)
    return seq[np.lexsort((-pos, -first[b]))]


def walk_order(blob: bytes, offsets: np.ndarray) -> np.ndarray | None:
    """The ids 0..n-1 in the order llama.cpp's map visits them (strings as in `string_hashes`), or
    None for a vocabulary larger than the bucket table above covers."""
    n = len(offsets) - 1
    if n == 0 or n >= _BUCKETS[-1]:
        return None
    h = string_hashes(blob, offsets)
    order = np.zeros(0, dtype=np.int64)
    inserted = 0
    for count in _BUCKETS:
        upto = min(n, count)  # the next rehash happens before inserting id `count`
        seq = np.concatenate([order, np.arange(inserted, upto)])
        order = _relink(seq, (h % np.uint64(count)).astype(np.int64))
        inserted = upto
        if upto == n:
            return order
    return None
