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


# --- the warm-up: its steps, run at load (Runtime.warm_up) and by precompile's compile workers ----
PROMPT_TOKENS = 9  # the warm-up's prompt batch: more than one group of 4/8 tokens
SEQS_TOKENS = 3  # the warm-up's short batch: a prompt's tail, a decode step of several sequences


def layer_kinds(model, cfg, layer_devices) -> dict:
    """(tensor types and rows, sliding window, last layer) -> the first CPU layer of that kind."""
    last = len(layer_devices) - 1
    kinds: dict = {}
    for il, d in enumerate(layer_devices):
        if d == "cpu":
            w = tuple((getattr(t, "ggml_type", None), getattr(t, "n_rows", None)) for t in vars(model.blocks[il]).values())
            kinds.setdefault((w, cfg.swa_layers[il], il == last), il)
    return kinds


def warm_up_steps(model, cfg, layer_devices, output_device: str, n_seq: int, fused: bool = True) -> list[tuple]:
    """The warm-up's steps: ("block", il, n_tok, last_only) for one CPU layer of each kind (a prompt
    batch; on the last layer the same batch with only its last row going on; a short batch: a
    prompt's tail or a decode step of several sequences), one token through the layers: ("layers", (il, ...), 1), one layer
    of each kind in one fused call as a decode step of an all-CPU model runs them (the kernel
    variant of all their types together), or ("block", il, 1, False) per kind when some layers are
    on the GPU (the CPU layers then decode one by one), or when `fused` is False (the fused decode
    kernel is not to be run yet: kernels.cpu.backend.FUSED_READY; the one-token block then runs the
    unfused kernels); then ("head", n_tok) for the output head's products when they run on the CPU."""
    last = len(layer_devices) - 1
    all_cpu = all(d == "cpu" for d in layer_devices) and fused
    batches = [(PROMPT_TOKENS, False), (PROMPT_TOKENS, True)] + ([] if all_cpu else [(1, False)]) + [
        (SEQS_TOKENS, False)]
    kinds = tuple(layer_kinds(model, cfg, layer_devices).values())
    steps = []
    for il in kinds:
        for n, last_only in batches:
            if not last_only or il == last:
                steps.append(("block", il, n, last_only))
    if all_cpu and kinds:
        steps.append(("layers", kinds, 1))
    if output_device == "cpu" and hasattr(model.output, "ggml_type"):
        steps += [("head", n) for n in (PROMPT_TOKENS, 1, SEQS_TOKENS)]
    return steps


def run_warm_up_step(step: tuple, cfg, cpu, model, kv_dtype) -> None:
    """One warm-up step on scratch buffers: blocks on 16-slot scratch caches of kv_dtype (reading
    only those layers' weights), or the head's products on 8 of its rows."""
    def scratch_kv(il):
        window = cfg.sliding_window if cfg.swa_layers[il] else 0
        return cpu.kv_layer(16, cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v, kv_dtype, window)

    if step[0] == "block":
        _, il, n, last_only = step
        x = model.embed(np.zeros(n, np.int64))
        model.block(il, cpu, x, np.arange(n, dtype=np.int64), scratch_kv(il), rows=slice(n - 1, n) if last_only else None)
    elif step[0] == "layers":
        _, layers, n = step
        kvs = [scratch_kv(il) for il in layers]
        pos = np.arange(n, dtype=np.int64)
        if not model.decode_all(model.embed(np.zeros(n, np.int64)), pos, kvs, layers=list(layers)):
            for il, kv in zip(layers, kvs):  # the unfused ops, layer by layer
                model.block(il, cpu, model.embed(np.zeros(n, np.int64)), pos, kv)
    else:
        _, n = step
        w = model.output
        rows = cpu.kernels.bind(w.ggml_type, w.data[:8], w.n_cols)
        if not w.data.flags.writeable:
            rows.pack()  # a mapped Q4_K head is packed by eight (CPUBackend._matrix): load those kernels
        h = np.zeros((n, cfg.n_embd), np.float32)
        cpu.rms_norm(h, model.output_norm, cfg.rms_eps, h)
        rows.matmul(h, np.empty((n, 8), np.float32))


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
        self._kernels_loaded = -1  # loaded CPU kernel count when the compiler was last released
        self._decode_checks = 0
        self._fused_pending = False  # the fused decode kernel was still compiling at the warm-up
        self.warm_up(on_compile)
        cpu.make_resident(self.model)

    def warm_up(self, on_compile=None) -> None:
        """Load the CPU kernels a prompt and a decode step run before any weight is read, then hand
        the compiler's memory back (kernels.cpu.release_compiler). Loading kernels runs LLVM, whose
        pages would otherwise stay resident beside the weights for the whole run. One CPU layer of
        each kind (its tensor types and row counts, sliding window or not, last or not) runs a
        9-token batch and a token on a scratch cache, reading only that layer's weights (and a
        3-token batch, the decode step of several sequences, when there can be several); the output
        head's products run on 8 of its rows. on_compile(kernel_name), if given, is called as each
        kernel starts compiling (the first run of an install; later runs load them from disk)."""
        cpu = self.backends["cpu"]
        if on_compile is not None:
            with cpu.kernels.compile_listener(on_compile):
                self._warm_up(cpu)
        else:
            self._warm_up(cpu)
        self.model.offloaded = 0.0
        self._release_compiler()

    def _warm_up(self, cpu) -> None:
        from edgellm.kernels.cpu.backend import FUSED_READY

        dtype = self.cache.kv_type.kernel_dtype  # a quantized cache's attention runs the float32 kernels
        self._fused_pending = not FUSED_READY.is_set()
        steps = warm_up_steps(self.model, self.cfg, self.layer_devices, self.output_device, self.n_seq,
                              fused=not self._fused_pending)
        for step in steps:
            run_warm_up_step(step, self.cfg, cpu, self.model, dtype)

    def _fused_ready(self) -> bool:
        """The fused decode kernel, still compiling at the warm-up, is ready now (True once)."""
        from edgellm.kernels.cpu.backend import FUSED_READY

        if FUSED_READY.is_set():
            self._fused_pending = False
            return True
        return False

    def _release_compiler(self) -> None:
        """Release the compiler's pages if kernels were loaded since the last time."""
        if "cpu" not in self.backends:
            return
        kernels = self.backends["cpu"].kernels
        n = kernels.loaded_kernels()
        if n != self._kernels_loaded:
            kernels.release_compiler()
            self._kernels_loaded = n

    # ---------------------------------------------------------------------------------------
    def exact_decode_rows(self) -> int:
        """The most single-token rows one step may hold with every row still in the one-token order
        (the bits it gets decoded alone): the fused decode kernel's cap for the weights' types, which
        the unfused products keep too (K-quant batches tile from 8 rows on); 1 when some product
        would take a batch order (float weights, a GPU layer)."""
        from edgellm.backend import QMatrix
        from edgellm.kernels.cpu import fused
        from edgellm.models.decoder import ALONE_MAX

        if any(d != "cpu" for d in self.layer_devices + self.expert_devices) or self.output_device != "cpu":
            return 1
        mats = [w for L in self.model.blocks for w in vars(L).values() if isinstance(w, QMatrix)]
        mats += [self.model.output] if isinstance(self.model.output, QMatrix) else []
        types = {int(w.ggml_type) for w in mats}
        if not mats or not types <= fused.ROW_TYPES or not isinstance(self.model.output, QMatrix):
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
        cache) except those in `hold`, whose caller commits only the tokens it keeps."""
        from edgellm.kv_cache import build_layouts

        for b in self.backends.values():
            b.claim_thread()
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
        # the fused decode kernel, still compiling at the warm-up, is loaded from the cache by this step
        taking_up = self._fused_pending and self._fused_ready()
        logits = None
        for i in range(0, len(ids), self.n_batch):
            logits = self._run(seq, ids[i : i + self.n_batch], all_logits=False)
        if len(ids) > 1 or self._decode_checks < 2 or taking_up:  # a kernel warm_up did not foresee
            self._decode_checks += len(ids) == 1
            self._release_compiler()
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
            logits = self.forward([(seq, ids)], rows=None if first == 0 else list(range(first, len(ids))))
            self._release_compiler()
            return logits
        out = np.empty((len(ids) - first, self.cfg.n_vocab), dtype=np.float32)
        for i in range(0, len(ids), self.n_batch):
            chunk = ids[i : i + self.n_batch]
            lo = max(first - i, 0)
            rows = None if lo == 0 else list(range(lo, len(chunk)))
            got = self.forward([(seq, chunk)], rows=rows)
            if len(got):
                out[i + lo - first : i + len(chunk) - first] = got
        self._release_compiler()
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
