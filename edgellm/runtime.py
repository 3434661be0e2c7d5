"""Layer execution across devices: one forward step over a ragged batch, per-device timing.

A step takes tokens of one or more sequences (each token with its own position; a sequence's KV
blocks come from the paged cache in edgellm/kv_cache.py) and returns the logits of the rows asked
for. The hidden state starts on the CPU (token embedding), runs each block on its layer's backend and
crosses a device boundary only where the layer map changes device (once per direction per step with
the planner's contiguous split), then the output head runs on its own device.

`eval` / `logits` / `reset` drive one built-in sequence (the single-context API); the scheduler
(edgellm/scheduler.py) drives many through `forward`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from edgellm.errors import ContextFullError, InvalidArgumentError, KVCacheFullError



@dataclass
class StepTiming:
    """Seconds spent per device (and in transfers) since the last reset."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    crossings: int = 0  # copies of the step's activations between devices

    def add(self, device: str, dt: float) -> None:
        self.seconds[device] = self.seconds.get(device, 0.0) + dt


class Runtime:
    """The model's layers on their backends and its KV cache, as `plan` (edgellm.planner.Plan) places
    them: plan.layers (a device per block), plan.output_device, plan.shape (n_ctx, n_batch, n_seq,
    kv_type, kv_size). backends: device -> Backend, "cpu" always (the embedding runs there)."""

    def __init__(self, gf, cfg, plan, backends: dict, *, on_compile=None):
        from edgellm.kv_cache import KVCache
        from edgellm.models import architecture

        shape = plan.shape
        n_ctx, n_batch, n_seq = shape.n_ctx, shape.n_batch, shape.n_seq
        if n_ctx < 1 or n_batch < 1:
            raise InvalidArgumentError(f"n_ctx and n_batch must be >= 1 (got {n_ctx}, {n_batch})")
        if int(n_seq) != n_seq or n_seq < 1:
            raise InvalidArgumentError(f"n_seq must be an integer >= 1 (parallel sequences), got {n_seq}")
        self.cfg = cfg
        self.plan = plan
        self._tensors = gf.tensors  # the file's tensor table (memory figures)
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.n_seq = int(n_seq)
        self.backends = backends
        self.layer_devices = list(plan.layers)
        self.output_device = plan.output_device
        cpu = backends["cpu"]
        module = architecture(cfg.arch)
        self.expert_devices = list(plan.experts) or list(self.layer_devices)
        self.model = module.Model(cfg, gf, [backends[d] for d in self.layer_devices], backends[self.output_device],
                                  cpu, n_ctx=n_ctx, expert_backends=[backends[d] for d in self.expert_devices])
        self.timing = StepTiming()
        self.model.timing = self.timing
        self.cache = KVCache(cfg, [backends[d] for d in self.layer_devices], n_ctx=n_ctx, n_batch=n_batch,
                             n_seq=self.n_seq, kv_type=shape.kv_type, kv_size=shape.kv_size)
        self.kv = self.cache.layers  # per layer: K, V arrays and the step layout
        self.seq = None  # the single-context API's sequence (created on first use)
        self._each_backend = list({id(b): b for b in backends.values()}.values())
        cpu.run(self._prepare, on_compile)  # on the thread that will run the steps

    def _prepare(self, on_compile) -> None:
        # each backend loads what the steps will run before any weight is read (the CPU: its kernels)
        for b in self._each_backend:
            b.prepare(self.model, self.cfg, self.layer_devices, self.output_device, self.n_seq,
                      self.cache.kv_type.kernel_dtype, on_compile=on_compile)
        self.model.offloaded = 0.0
        self.backends["cpu"].make_resident(self.model)

    # ---------------------------------------------------------------------------------------
    def exact_decode_rows(self) -> int:
        """The most single-token rows one step may hold with every row still in the one-token order
        (the bits it gets decoded alone): the fused decode kernel's cap for the weights' types, which
        the unfused products keep too (K-quant batches tile from 8 rows on); 1 when some product
        would take a batch order (float weights, a GPU layer)."""
        from edgellm.backend import QMatrix
        from edgellm.kernels.cpu import fused
        from edgellm.kernels.cpu.tensor_types import FUSED_TYPES
        from edgellm.models.decoder import ALONE_MAX

        if any(d != "cpu" for d in self.layer_devices + self.expert_devices) or self.output_device != "cpu":
            return 1
        mats = [w for L in self.model.blocks for w in vars(L).values() if isinstance(w, QMatrix)]
        mats += [self.model.output] if isinstance(self.model.output, QMatrix) else []
        types = {int(w.ggml_type) for w in mats}
        if not mats or not types <= FUSED_TYPES or not isinstance(self.model.output, QMatrix):
            return 1
        return min(ALONE_MAX, fused.max_tokens(types))

    def kv_bytes(self) -> dict[str, int]:
        return self.cache.nbytes()

    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes held per device: {"weights": the tensors placed there (mapped on the CPU, with the
        Q4_K rows packed by eight once bound; uploaded on the GPU), "kv_cache": its cache arrays}."""
        from edgellm.planner import device_weights

        sizes = self._sizes()
        # a tied head on the CPU is the embedding already counted; anywhere else it is its own copy
        head = sizes.head if (not sizes.tied_output or self.output_device != "cpu") else 0
        weights = device_weights(sizes, self.layer_devices, self.output_device, sizes.token_embd, head,
                                 self.plan.experts)
        packed = getattr(self.backends.get("cpu"), "packed_extra_bytes", None)
        if packed is not None:  # 37 bytes for every 36 of the file
            weights["cpu"] += packed()
        kv = self.kv_bytes()
        return {dev: {"weights": weights.get(dev, 0), "kv_cache": kv.get(dev, 0)}
                for dev in sorted(set(weights) | set(kv))}

    def weights_read_per_token(self) -> dict[str, int]:
        """Bytes of weights one decode step reads on each device: the blocks placed there (of a
        mixture of experts, the share of experts a token uses), the output norm and the whole head
        on the output device, other tensors on the CPU (the token embeddings: one row, not counted)."""
        from edgellm.planner import device_weights

        sizes = self._sizes()
        extra = getattr(self.cfg, "extra", None) or {}
        share = extra["n_expert_used"] / extra["n_expert"] if "n_expert" in extra else 1.0
        return device_weights(sizes, self.layer_devices, self.output_device, sizes.other, sizes.head,
                              self.plan.experts, expert_share=share)

    def _sizes(self):
        from edgellm.planner import WeightSizes

        if getattr(self, "_weight_sizes", None) is None:
            self._weight_sizes = WeightSizes.from_tensors(self._tensors, len(self.layer_devices))
        return self._weight_sizes

    # --- one step over a ragged batch -------------------------------------------------------------
    def forward(self, entries, rows=None, hold=()) -> np.ndarray:
        """One forward step. entries: [(SeqKV, token ids int64 (n,))] — each sequence's tokens go at
        its next positions; entries of one token first; blocks for them must have been allocated
        (SeqKV.grow). A SeqKV may appear in several entries (speculative verification: one
        single-token entry per position); its entries take consecutive positions in order. Every
        step writes all its K/V before any attention, so each entry sees the earlier ones' keys.
        rows: indices (into the concatenated tokens) whose logits are returned, None for all.
        Returns host float32 (n_rows, n_vocab); the sequences are committed (their tokens are in the
        cache) except those in `hold`, whose caller commits only the tokens it keeps. Runs on the
        CPU backend's kernel thread (Backend.run)."""
        return self.backends["cpu"].run(self._forward, entries, rows, hold)

    def _forward(self, entries, rows, hold) -> np.ndarray:
        from edgellm.kv_cache import build_layouts

        ids = np.concatenate([e[1] for e in entries]).astype(np.int64, copy=False)
        pos_list, taken = [], {}  # id(SeqKV) -> tokens placed so far in this step
        for seq, t in entries:
            p0 = seq.n_past + taken.get(id(seq), 0)
            taken[id(seq)] = taken.get(id(seq), 0) + len(t)
            pos_list.append(np.arange(p0, p0 + len(t), dtype=np.int64))
        pos = np.concatenate(pos_list)
        layouts = build_layouts(self.cache, [(seq, p) for (seq, _), p in zip(entries, pos_list)])
        for il, lk in enumerate(self.kv):
            lk.layout = layouts[self.cache.group_of[il]]
        n = len(ids)
        if rows is not None and len(rows) == 1 and rows[0] == n - 1:
            rows = slice(n - 1, n)  # the last row: a view, as a one-sequence prompt always had it
        timing = self.timing
        t0 = time.perf_counter()
        x = self.model.embed(ids)
        cur = self.backends["cpu"]
        timing.add("cpu", time.perf_counter() - t0)
        last = len(self.model.layer_backends) - 1
        t0 = time.perf_counter()
        if last >= 0 and self.layer_devices[0] == "cpu" and self.model.decode_all(x, pos, self.kv):
            # decode tokens through every layer in one kernel call (all layers on the CPU)
            timing.add("cpu", time.perf_counter() - t0)
            if rows is not None:
                x = x[rows]
        else:
            for il, b in enumerate(self.model.layer_backends):
                if b is not cur:
                    x = self._cross(x, cur, b)
                    cur = b
                t0 = time.perf_counter()
                x = self.model.block(il, b, x, pos, self.kv[il], rows=rows if il == last else None)
                b.synchronize()
                # a split block's experts and crossings are counted on their own (Decoder.offloaded)
                timing.add(b.device, time.perf_counter() - t0 - self.model.offloaded)
                self.model.offloaded = 0.0
        if last < 0 and rows is not None:
            x = x[rows]
        ob = self.model.output_backend
        if x.shape[0] == 0:  # no logits wanted (a prompt chunk that does not end its prompt)
            logits = np.empty((0, self.cfg.n_vocab), np.float32)
        else:
            if ob is not cur:
                x = self._cross(x, cur, ob)
            t0 = time.perf_counter()
            logits = self.model.head(x)
            timing.add(ob.device, time.perf_counter() - t0)
        timing.tokens += n
        for b in self._each_backend:
            b.after_step((len(entries), n))
        held = {id(seq) for seq in hold}
        for seq, t in entries:
            if id(seq) not in held:
                seq.commit(t)
        return logits

    def _cross(self, x, src, dst):
        t0 = time.perf_counter()
        y = dst.from_host(src.to_host(x))
        dst.synchronize()
        self.timing.add("transfer", time.perf_counter() - t0)
        self.timing.crossings += 1
        return y

    # --- the single-context API -------------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.seq.n_past if self.seq is not None else 0

    def reset(self) -> None:
        if self.seq is not None:
            self.seq.free()

    def _own_seq(self):
        if self.seq is None:
            self.seq = self.cache.new_sequence()
        return self.seq

    def _check_room(self, seq, n: int) -> None:
        if n == 0:
            raise InvalidArgumentError("no tokens to evaluate")
        if seq.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"context full: {seq.n_past} tokens in context + {n} new > n_ctx {self.n_ctx}; "
                "start a new context (reset) or load with a larger n_ctx"
            )
        if not seq.grow(n):
            raise KVCacheFullError(
                f"the KV cache has no free blocks for {n} more tokens (other sequences hold them); "
                "wait for them to finish or load with a larger kv_size"
            )

    def _run(self, seq, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        return self.forward([(seq, ids)], rows=None if all_logits else [len(ids) - 1])

    def eval(self, tokens) -> np.ndarray:
        """Append tokens (prefill in batches of n_batch); float32 (n_vocab,) logits after the last."""
        ids = self._ids(tokens)
        seq = self._own_seq()
        self._check_room(seq, len(ids))
        logits = None
        for i in range(0, len(ids), self.n_batch):
            logits = self._run(seq, ids[i : i + self.n_batch], all_logits=False)
        return logits[-1]

    def logits(self, tokens, first: int = 0) -> np.ndarray:
        """Fresh context; float32 (n_tok - first, n_vocab) logits at positions first.. (the rows
        before `first` skip the output head, as llama.cpp's output-row selection does)."""
        ids = self._ids(tokens)
        if not 0 <= first < max(len(ids), 1):
            raise InvalidArgumentError(f"first must be in 0..{len(ids) - 1}, got {first}")
        self.reset()
        seq = self._own_seq()
        self._check_room(seq, len(ids))
        if len(ids) <= self.n_batch:  # one batch: its logits are the answer, no copy
            return self.forward([(seq, ids)], rows=None if first == 0 else list(range(first, len(ids))))
        out = np.empty((len(ids) - first, self.cfg.n_vocab), dtype=np.float32)
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            lo = max(first - i, 0)
            rows = None if lo == 0 else list(range(lo, len(chunk)))
            got = self.forward([(seq, chunk)], rows=rows)
            if len(got):
                out[i + lo - first : i + len(chunk) - first] = got
        return out

    def _ids(self, tokens) -> np.ndarray:
        if isinstance(tokens, np.ndarray) and tokens.dtype.kind in "iu":
            ids = tokens.astype(np.int64, copy=False).reshape(-1)
            if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.n_vocab):
                bad = int(ids[(ids < 0) | (ids >= self.cfg.n_vocab)][0])
                raise InvalidArgumentError(f"token id {bad} is outside the vocabulary (0..{self.cfg.n_vocab - 1})")
            return ids
        if isinstance(tokens, (list, tuple)) and len(tokens) > self.n_ctx:  # refused before checking each id
            raise ContextFullError(f"context full: {len(tokens)} new tokens > n_ctx {self.n_ctx}; "
                                   "pass fewer or load with a larger n_ctx")
        from edgellm.tokenizer import token_ids

        return np.asarray(token_ids(tokens, self.cfg.n_vocab), dtype=np.int64)
