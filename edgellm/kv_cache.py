"""The KV cache: a pool of fixed-size blocks per group of layers, block tables per sequence, prefix reuse.

Layers that attend the same way share a *group*: every full-attention layer in one, the sliding-window
layers (Gemma-3) in another. A group holds, per layer, K and V arrays of `n_blocks * block_size` slots
on the layer's device, and one host-side bookkeeping `BlockPool` for all its layers (block b holds
slots [b * block_size, (b + 1) * block_size) in every layer of the group). A sequence owns one block
table per group: position p lives in slot table[p // block_size] * block_size + p % block_size.

Prefix reuse (llama-server's cache_prompt, vLLM's prefix caching): a block that is full is immutable;
it is registered under a hash of its tokens chained to the hash of the block before it, so equal
hashes mean equal tokens at equal positions. A new sequence looks its prompt's full blocks up and
shares the ones it finds (reference counts); it only ever writes into blocks of its own, so sharing
needs no copy. Blocks whose last user left stay cached (LRU) until the pool needs them.

A sliding-window group keeps only the blocks that hold the window: blocks that fall out of every
future query's window go back to the pool (cached, so a later request with the same prefix can
still use them).

Bytes: `kv_bytes_per_token` is the one formula for a layer's K and V; the planner's ledger and the
allocation here both use it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from edgellm.backend import KVLayer
from edgellm.errors import InvalidArgumentError

BLOCK_SIZE = 16  # tokens per block; a multiple of 8 (the attention kernels read keys 4 and 8 at a time)
KEY_ALIGN = 32  # a sliding window's key list starts at a multiple of this (4 accumulators x 8 lanes)


@dataclass(frozen=True)
class KVType:
    name: str
    dtype: type  # element type of the cache arrays (uint8 for block-quantized types)
    bytes_per_value: float  # storage per K or V value, block scales included
    ggml_type: int | None = None  # block-quantized: the GGML type of a row of head_dim values

    @property
    def quantized(self) -> bool:
        return self.ggml_type is not None

    @property
    def kernel_dtype(self):
        """The element type the attention kernels run on: a quantized cache's dequantized float32."""
        return np.float32 if self.quantized else self.dtype

    def row_bytes(self, n: int) -> int:
        """Bytes of one head's n values."""
        return int(n * self.bytes_per_value)


KV_TYPES = {
    "f16": KVType("f16", np.float16, 2.0),
    "f32": KVType("f32", np.float32, 4.0),
    # llama.cpp's quantized caches (-ctk/-ctv q8_0 | q4_0): blocks of 32 values with an f16 scale,
    # 2 + 32 and 2 + 16 bytes
    "q8_0": KVType("q8_0", np.uint8, (2 + 32) / 32, 8),
    "q4_0": KVType("q4_0", np.uint8, (2 + 16) / 32, 2),
}


def kv_type(name: str) -> KVType:
    t = KV_TYPES.get(str(name).lower())
    if t is None:
        raise InvalidArgumentError(f"kv_type must be one of {', '.join(KV_TYPES)}, not {name!r}")
    return t


def kv_bytes_per_token(cfg, kind: str) -> int:
    """Bytes one token's K and V take in one layer: (head_dim_k + head_dim_v) * n_head_kv values."""
    return int((cfg.head_dim_k + cfg.head_dim_v) * cfg.n_head_kv * kv_type(kind).bytes_per_value)


def layer_window(cfg, il: int) -> int:
    """Sliding window of layer il (0: full attention)."""
    return cfg.sliding_window if (cfg.sliding_window > 0 and cfg.swa_layers[il]) else 0


def blocks_per_sequence(window: int, n_ctx: int, n_batch: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks one sequence needs at most in a group: its context, or for a sliding window the
    window plus one batch of new tokens, the key list's alignment and a partial block."""
    n = n_ctx if window <= 0 else min(n_ctx, window + n_batch + KEY_ALIGN + block_size)
    return -(-n // block_size)


def pool_blocks(window: int, *, n_ctx: int, n_batch: int, n_seq: int, kv_size: int | None = None,
                block_size: int = BLOCK_SIZE) -> int:
    """Blocks in a group's pool: room for n_seq full sequences, or kv_size tokens when given (a pool
    smaller than n_seq contexts preempts sequences when it runs out, see the scheduler)."""
    per_seq = blocks_per_sequence(window, n_ctx, n_batch, block_size)
    if kv_size is not None:
        full = -(-int(kv_size) // block_size)
        return max(per_seq, min(full, per_seq * n_seq) if window > 0 else full)
    return per_seq * n_seq


# ============================================================================ block bookkeeping
class BlockPool:
    """Host-side state of a group's blocks: reference counts, the free list, the prefix cache."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE):
        if n_blocks < 1:
            raise InvalidArgumentError("the KV cache needs at least one block")
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.ref = np.zeros(n_blocks, np.int32)
        self.free: list[int] = list(range(n_blocks - 1, -1, -1))  # pop() takes block 0 first
        self.hash_of: dict[int, int] = {}  # block -> hash (full blocks only)
        self.block_of: dict[int, int] = {}  # hash -> block
        self.lru: OrderedDict[int, None] = OrderedDict()  # unreferenced hashed blocks, oldest first
        self.partial: dict[int, int] = {}  # hash of the full blocks before it -> a partial block
        self.partial_tokens: dict[int, tuple] = {}  # partial block -> (that hash, its tokens)

    # --- counts -------------------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return int(np.count_nonzero(self.ref))

    @property
    def n_cached(self) -> int:
        return len(self.lru)

    @property
    def n_available(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones that can be evicted."""
        return len(self.free) + len(self.lru)

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int | None:
        """A block for one sequence (reference 1); a free one first, then the least recently used
        cached one (forgetting its hash). None when every block is in use."""
        if self.free:
            b = self.free.pop()
        elif self.lru:
            b, _ = self.lru.popitem(last=False)
            if b in self.hash_of:
                del self.block_of[self.hash_of.pop(b)]
            else:  # a sequence's last, partial block
                del self.partial[self.partial_tokens.pop(b)[0]]
        else:
            return None
        self.ref[b] = 1
        return b

    def share(self, b: int) -> None:
        if self.ref[b] == 0:
            self.lru.pop(b, None)
        self.ref[b] += 1

    def release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.hash_of or b in self.partial_tokens:
                self.lru[b] = None  # kept for prefix reuse until the pool needs it
            else:
                self.free.append(b)

    def keep_partial(self, b: int, parent: int, tokens: tuple) -> None:
        """Block b, about to be released, holds a sequence's last tokens (fewer than a block) after
        the full blocks hashed to `parent`: a later prompt with the same start may copy them."""
        if b in self.hash_of:
            return
        old = self.partial.pop(parent, None)  # the latest sequence's tail replaces an older one
        if old is not None:
            self.partial_tokens.pop(old, None)
            if self.ref[old] == 0 and old in self.lru:
                del self.lru[old]
                self.free.append(old)
        self.partial[parent] = b
        self.partial_tokens[b] = (parent, tokens)

    def register(self, b: int, h: int) -> None:
        """Block b is full and holds the tokens hashed to h: others may share it from now on."""
        if b in self.hash_of or h in self.block_of:
            return  # an equal block is registered already (two sequences computed the same prefix)
        self.hash_of[b] = h
        self.block_of[h] = b

    def lookup(self, h: int) -> int | None:
        return self.block_of.get(h)


def block_hashes(tokens, block_size: int = BLOCK_SIZE) -> list[int]:
    """Chained hashes of the full blocks of `tokens`: block i's hash covers tokens [0, (i+1) * bs)."""
    out, h = [], 0
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


# ============================================================================ the cache
class KVGroup:
    """Layers sharing a window: their K/V arrays (one pair per layer, on the layer's device) and the
    pool that hands out their blocks."""

    def __init__(self, window: int, layers: list[int], n_blocks: int, block_size: int):
        self.window = window
        self.layers = layers
        self.pool = BlockPool(n_blocks, block_size)
        self.slot_pos = np.full(n_blocks * block_size, -1, np.int64)  # position held per slot (host)


class KVCache:
    """All groups of a model's layers; sequences' block tables; the step layout the kernels read.

    backends[il].kv_arrays(n_slots, ...) allocates layer il's K and V; the arrays are indexed by slot.
    """

    def __init__(self, cfg, layer_backends, *, n_ctx: int, n_batch: int, n_seq: int, kv_type: str = "f16",
                 kv_size: int | None = None, block_size: int = BLOCK_SIZE):
        kt = globals()["kv_type"](kv_type)
        if block_size % 8 or KEY_ALIGN % block_size and block_size % KEY_ALIGN:
            raise InvalidArgumentError(f"block_size must be 8, 16, 32 or a multiple of 32, got {block_size}")
        self.cfg = cfg
        self.kv_type = kt
        self.block_size = block_size
        self.n_ctx = n_ctx
        # tokens a sequence may be cut back by (SeqKV.truncate: a draft model's rejected tokens);
        # blocks are registered for reuse, and window blocks given back, only behind this margin
        self.rollback = 0
        windows = [layer_window(cfg, il) for il in range(cfg.n_layer)]
        self.groups: list[KVGroup] = []
        self.group_of: list[int] = []
        for w in sorted(set(windows)):
            layers = [il for il in range(cfg.n_layer) if windows[il] == w]
            n = pool_blocks(w, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq, kv_size=kv_size, block_size=block_size)
            self.groups.append(KVGroup(w, layers, n, block_size))
        gi = {g.window: i for i, g in enumerate(self.groups)}
        self.group_of = [gi[w] for w in windows]
        if kt.quantized and (cfg.head_dim_k % 32 or cfg.head_dim_v % 32):
            raise InvalidArgumentError(f"a {kt.name} KV cache needs head sizes divisible by 32 "
                                       f"(this model: {cfg.head_dim_k}, {cfg.head_dim_v}); use f16")
        self.layers = []  # per layer: PagedKV
        for il, b in enumerate(layer_backends):
            g = self.groups[self.group_of[il]]
            n_slots = g.pool.n_blocks * block_size
            if kt.quantized:  # each head's values as one row of blocks
                k = b.kv_array((n_slots, cfg.n_head_kv, kt.row_bytes(cfg.head_dim_k)), kt.dtype)
                v = b.kv_array((n_slots, cfg.n_head_kv, kt.row_bytes(cfg.head_dim_v)), kt.dtype)
            else:
                k = b.kv_array((n_slots, cfg.n_head_kv, cfg.head_dim_k), kt.dtype)
                v = b.kv_array((n_slots, cfg.n_head_kv, cfg.head_dim_v), kt.dtype)
            self.layers.append(PagedKV(k, v, g.slot_pos, g.window, b.device, kt if kt.quantized else None))

    # --- memory ---------------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lk in self.layers:
            out[lk.device] = out.get(lk.device, 0) + int(lk.k.nbytes + lk.v.nbytes)
        return out

    def block_counts(self) -> dict[str, int]:
        """Blocks total / used (held by a sequence) / cached (kept for reuse) / free, over the groups."""
        total = sum(g.pool.n_blocks for g in self.groups)
        used = sum(g.pool.n_used for g in self.groups)
        cached = sum(g.pool.n_cached for g in self.groups)
        free = sum(len(g.pool.free) for g in self.groups)  # counted, not inferred: used + cached + free
        return {"total": total, "used": used, "cached": cached, "free": free}  # != total is a lost block

    # --- sequences ------------------------------------------------------------------------------
    def new_sequence(self) -> "SeqKV":
        return SeqKV(self)


class PagedKV(KVLayer):
    """The paged cache's KVLayer: one layer's K and V arrays over every sequence's blocks and its
    group's slot positions; the runtime sets `layout` (a StepLayout) before each step."""

    def __init__(self, k, v, slot_pos, window, device, quant: KVType | None = None):
        self.k, self.v, self.pos, self.window, self.device = k, v, slot_pos, window, device
        self.quant = quant  # a block-quantized type: k, v hold each head's row of blocks (uint8)
        self.layout = None  # the step's StepLayout for this layer's group, set by the runtime

    def slots(self, positions):
        """Slots the step's tokens are written to (the step layout decides; positions unused)."""
        return self.layout.slots


@dataclass
class StepLayout:
    """Where one step's tokens go and what they attend to, in one group.

    Tokens [0, n_single) attend alone (decode tokens, one-token chunks: the one-token kernel and its
    order); `chunks` are (t0, t1) ranges of two or more tokens of one sequence (the batch kernel).
    Token t's keys are slots kmap[kbeg[t]:kend[t]], in position order; `slots[t]` is where its own
    K and V are written."""

    slots: np.ndarray  # int64 (n_tok,)
    kmap: np.ndarray  # int64 (n_keys,)
    kbeg: np.ndarray  # int64 (n_tok,)
    kend: np.ndarray  # int64 (n_tok,)
    n_single: int
    chunks: list  # [(t0, t1)]


class SeqKV:
    """One sequence's block tables (one per group) and its length in the cache."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.tables: list[list[int | None]] = [[] for _ in cache.groups]  # None: a block given back
        self.hashes: list[int] = []  # chained hashes of the full blocks written so far
        self.tokens: list[int] = []  # tokens in the cache, in position order
        self.n_registered = 0  # full blocks registered for reuse

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    # --- prefix reuse -----------------------------------------------------------------------------
    def reuse_prefix(self, tokens) -> int:
        """Share the longest cached prefix of `tokens` (whole blocks, leaving at least the last token
        to evaluate); returns the number of tokens taken from the cache. The sequence must be empty."""
        assert not self.tokens
        bs = self.cache.block_size
        hashes = block_hashes(list(tokens[: len(tokens) - 1]), bs)
        groups = self.cache.groups
        n = 0
        full = [g for g in groups if g.window == 0]
        # blocks every full-attention group has
        while n < len(hashes) and all(g.pool.lookup(hashes[n]) is not None for g in full):
            n += 1
        # a sliding-window group needs only the blocks inside the window before the cut
        while n > 0 and not all(self._window_present(g, hashes, n) for g in groups if g.window > 0):
            n -= 1
        k, partials = self._partial_match(tokens, hashes, n)
        if n == 0 and k == 0:
            return 0
        for gi, g in enumerate(groups):
            first = 0 if g.window == 0 else self._first_needed_block(g.window, n * bs)
            table = self.tables[gi]
            for i in range(n):
                if i < first:
                    table.append(None)
                else:
                    b = g.pool.lookup(hashes[i])
                    g.pool.share(b)
                    table.append(b)
        self.hashes = hashes[:n]
        self.n_registered = n
        self.tokens = list(tokens[: n * bs])
        if k and not all(g.pool.n_available >= 2 for g in groups):
            k = 0  # sharing the full blocks took the pool's last spare ones: no block to copy into
        if k:  # the partial block's first k tokens, copied into a block of this sequence's own
            for gi, (g, src) in enumerate(zip(groups, partials)):
                g.pool.share(src)  # held while copying: allocate() must not hand it out
                dst = g.pool.allocate()
                g.pool.release(src)
                for il in g.layers:
                    lk = self.cache.layers[il]
                    lk.k[dst * bs:dst * bs + k] = lk.k[src * bs:src * bs + k]
                    lk.v[dst * bs:dst * bs + k] = lk.v[src * bs:src * bs + k]
                g.slot_pos[dst * bs:dst * bs + k] = g.slot_pos[src * bs:src * bs + k]
                self.tables[gi].append(dst)
            self.tokens += list(tokens[n * bs:n * bs + k])
        return n * bs + k

    def _partial_match(self, tokens, hashes, n: int) -> tuple[int, list]:
        """(k, blocks): the first k tokens after the n shared blocks are at the start of a kept
        partial block in every group (k leaves the prompt's last token to evaluate); 0 if not, or
        if a group has no block to copy them into."""
        bs = self.cache.block_size
        parent = hashes[n - 1] if n else 0
        rest = tuple(tokens[n * bs:len(tokens) - 1])
        blocks, k = [], bs
        for g in self.cache.groups:
            b = g.pool.partial.get(parent)
            if b is None or g.pool.n_available < 2:
                return 0, []
            kept = g.pool.partial_tokens[b][1]
            m = 0
            while m < min(len(kept), len(rest)) and kept[m] == rest[m]:
                m += 1
            k = min(k, m)
            blocks.append(b)
        return (k, blocks) if k > 0 else (0, [])

    def _first_needed_block(self, window: int, n_pos: int) -> int:
        """First block a query at position >= n_pos can still see with this window; rounded down to
        KEY_ALIGN positions, so a key's index in the kernels' key list is its position modulo
        KEY_ALIGN (the lanes and 8-key chunks its sums go to stay those of a list from 0)."""
        start = max(0, n_pos - window + 1) // KEY_ALIGN * KEY_ALIGN
        return start // self.cache.block_size

    def _window_present(self, g: KVGroup, hashes, n: int) -> bool:
        first = self._first_needed_block(g.window, n * self.cache.block_size)
        return all(g.pool.lookup(hashes[i]) is not None for i in range(first, n))

    # --- growth -----------------------------------------------------------------------------------
    def blocks_needed(self, n_new: int) -> list[int]:
        """New blocks per group to hold n_new more tokens."""
        bs = self.cache.block_size
        need = -(-(self.n_past + n_new) // bs)
        return [max(0, need - len(t)) for t in self.tables]

    def can_grow(self, n_new: int) -> bool:
        return all(n <= g.pool.n_available for n, g in zip(self.blocks_needed(n_new), self.cache.groups))

    def grow(self, n_new: int) -> bool:
        """Allocate blocks for n_new more tokens; False (nothing allocated) if a pool is short."""
        if not self.can_grow(n_new):
            return False
        for gi, (n, g) in enumerate(zip(self.blocks_needed(n_new), self.cache.groups)):
            for _ in range(n):
                self.tables[gi].append(g.pool.allocate())
        return True

    def commit(self, tokens) -> None:
        """The step wrote `tokens` at positions n_past..: register blocks that became full and give
        back sliding-window blocks no later query can see (both behind the cache's rollback margin)."""
        self.tokens.extend(int(t) for t in tokens)
        self._settle(max(0, self.n_past - self.cache.rollback))

    def _settle(self, n_sure: int) -> None:
        """Hash the full blocks, register those before position n_sure, give back the window
        blocks no query at n_sure or later can see."""
        bs = self.cache.block_size
        h = self.hashes[-1] if self.hashes else 0
        while len(self.hashes) < self.n_past // bs:
            i = len(self.hashes)
            h = hash((h, tuple(self.tokens[i * bs:(i + 1) * bs])))
            self.hashes.append(h)
        n_full = n_sure // bs
        for gi, g in enumerate(self.cache.groups):
            table = self.tables[gi]
            for i in range(self.n_registered, n_full):
                if table[i] is not None:
                    g.pool.register(table[i], self.hashes[i])
            if g.window > 0:
                for i in range(self._first_needed_block(g.window, n_sure)):
                    if table[i] is not None:
                        g.pool.release(table[i])
                        table[i] = None
        self.n_registered = max(self.n_registered, n_full)

    def truncate(self, n: int) -> None:
        """Forget the tokens past the first n (at most the cache's rollback margin) and give back
        the blocks past them."""
        if n >= self.n_past:
            return
        if n < self.n_past - self.cache.rollback or n < self.n_registered * self.cache.block_size:
            raise InvalidArgumentError(f"cannot cut a sequence of {self.n_past} tokens back to {n}")
        del self.tokens[n:]
        del self.hashes[n // self.cache.block_size:]
        self.trim()

    def trim(self) -> None:
        """Give back the blocks past the last committed token: those grown for speculative tokens
        that were rejected (never hashed, so they go straight back to the free list)."""
        need = -(-self.n_past // self.cache.block_size)
        for gi, g in enumerate(self.cache.groups):
            table = self.tables[gi]
            while len(table) > need:
                b = table.pop()
                if b is not None:
                    g.pool.release(b)

    def free(self) -> None:
        """Give every block back (full ones stay cached for reuse, and so does the last, partial one:
        a chat's next turn starts with all of this sequence's tokens)."""
        bs = self.cache.block_size
        if self.cache.rollback:
            self._settle(self.n_past)  # no cut can come now: every full block may be shared
        n_full = self.n_past // bs
        if self.n_past % bs and n_full == len(self.hashes):
            parent = self.hashes[-1] if self.hashes else 0
            tail = tuple(self.tokens[n_full * bs:])
            for gi, g in enumerate(self.cache.groups):
                b = self.tables[gi][n_full] if n_full < len(self.tables[gi]) else None
                if b is not None and g.pool.ref[b] == 1:
                    g.pool.keep_partial(b, parent, tail)
        for gi, g in enumerate(self.cache.groups):
            for b in self.tables[gi]:
                if b is not None:
                    g.pool.release(b)
            self.tables[gi] = []
        self.tokens = []
        self.hashes = []
        self.n_registered = 0

    # --- addresses ----------------------------------------------------------------------------------
    def slots(self, gi: int, positions: np.ndarray) -> np.ndarray:
        bs = self.cache.block_size
        table = self.tables[gi]
        return np.array([table[p // bs] * bs + p % bs for p in positions], np.int64)

    def key_slots(self, gi: int, last_pos: int, first_pos: int) -> np.ndarray:
        """Slots of the keys queries at positions first_pos..last_pos may see, in position order:
        from the first block in the window of first_pos (0 for full attention) to last_pos."""
        g = self.cache.groups[gi]
        bs = self.cache.block_size
        table = self.tables[gi]
        start = 0 if g.window == 0 else self._first_needed_block(g.window, first_pos) * bs
        n_blocks = last_pos // bs + 1
        base = np.array(table[start // bs:n_blocks], np.int64) * bs
        keys = (base[:, None] + np.arange(bs, dtype=np.int64)[None, :]).reshape(-1)
        return keys[: last_pos + 1 - start]


def build_layouts(cache: KVCache, entries) -> list[StepLayout]:
    """One StepLayout per group for a step. entries: [(SeqKV, positions int64 array)] in batch
    order, single-token entries first (the runtime orders them so)."""
    layouts = []
    for gi in range(len(cache.groups)):
        slots, kmaps, kbeg, kend, chunks = [], [], [], [], []
        n_single, t, off = 0, 0, 0
        for seq, pos in entries:
            n = len(pos)
            slots.append(seq.slots(gi, pos))
            keys = seq.key_slots(gi, int(pos[-1]), int(pos[0]))
            kmaps.append(keys)
            kbeg.append(np.full(n, off, np.int64))
            kend.append(np.full(n, off + len(keys), np.int64))
            off += len(keys)
            if n == 1:
                assert t == n_single, "single-token entries come first"
                n_single += 1
            else:
                chunks.append((t, t + n))
            t += n
        layouts.append(StepLayout(np.concatenate(slots), np.concatenate(kmaps), np.concatenate(kbeg),
                                  np.concatenate(kend), n_single, chunks))
    return layouts
