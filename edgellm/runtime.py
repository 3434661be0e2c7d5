"""Layer execution across devices: KV cache, batched prefill, one-token decode, per-device timing.

The hidden state starts on the CPU (token embedding), runs each block on its layer's backend and
crosses a device boundary only where the layer map changes device (once per direction per step with
the planner's contiguous split), then the output head runs on its own device.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from edgellm.errors import ContextFullError, InvalidArgumentError

KV_DTYPES = {"f16": np.float16, "f32": np.float32}


@dataclass
class StepTiming:
    """Seconds spent per device (and in transfers) since the last reset."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens: int = 0

    def add(self, device: str, dt: float) -> None:
        self.seconds[device] = self.seconds.get(device, 0.0) + dt


def kv_cache_slots(cfg, il: int, n_ctx: int, n_batch: int) -> int:
    """Cache slots layer il needs: n_ctx, or window + n_batch for a sliding-window layer (a ring)."""
    if cfg.swa_layers[il] and cfg.sliding_window > 0:
        return min(n_ctx, cfg.sliding_window + n_batch)
    return n_ctx


class Runtime:
    def __init__(self, gf, cfg, *, layer_devices, output_device: str, backends: dict, n_ctx: int,
                 n_batch: int, kv_type: str = "f16", on_compile=None):
        from edgellm.models import architecture

        if kv_type not in KV_DTYPES:
            raise InvalidArgumentError(f"kv_type must be one of {', '.join(KV_DTYPES)}, not {kv_type!r}")
        if n_ctx < 1 or n_batch < 1:
            raise InvalidArgumentError(f"n_ctx and n_batch must be >= 1 (got {n_ctx}, {n_batch})")
        self.cfg = cfg
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.backends = backends
        self.layer_devices = list(layer_devices)
        self.output_device = output_device
        cpu = backends["cpu"]
        module = architecture(cfg.arch)
        self.model = module.Model(cfg, gf, [backends[d] for d in self.layer_devices], backends[output_device], cpu)
        dtype = KV_DTYPES[kv_type]
        self.kv = [
            backends[d].kv_layer(kv_cache_slots(cfg, il, n_ctx, n_batch), cfg.n_head_kv, cfg.head_dim_k,
                                 cfg.head_dim_v, dtype, cfg.sliding_window if cfg.swa_layers[il] else 0)
            for il, d in enumerate(self.layer_devices)
        ]
        self.n_past = 0
        self.timing = StepTiming()
        self._kernels_loaded = -1  # loaded CPU kernel count when the compiler was last released
        self._decode_checks = 0
        self.warm_up(on_compile)

    def warm_up(self, on_compile=None) -> None:
        """Load the CPU kernels a prompt and a decode step run before any weight is read, then hand
        the compiler's memory back (kernels.cpu.release_compiler). Loading kernels runs LLVM, whose
        pages would otherwise stay resident beside the weights for the whole run. One CPU layer of
        each kind (its tensor types and row counts, sliding window or not, last or not) runs a
        9-token batch and a token on a scratch cache, reading only that layer's weights; the output
        head's products run on 8 of its rows. on_compile(kernel_name), if given, is called as each
        kernel starts compiling (the first run of an install; later runs load them from disk)."""
        cpu = self.backends["cpu"]
        if on_compile is not None:
            with cpu.kernels.compile_listener(on_compile):
                self._warm_up(cpu)
        else:
            self._warm_up(cpu)
        self._release_compiler()

    def _warm_up(self, cpu) -> None:
        cfg, model = self.cfg, self.model
        last = len(self.layer_devices) - 1
        kinds: dict = {}
        for il, d in enumerate(self.layer_devices):
            if d == "cpu":
                w = tuple((getattr(t, "ggml_type", None), getattr(t, "n_rows", None)) for t in vars(model.blocks[il]).values())
                kinds.setdefault((w, cfg.swa_layers[il], il == last), il)
        dtype = self.kv[0].k.dtype if self.kv else np.float16
        for il in kinds.values():
            window = cfg.sliding_window if cfg.swa_layers[il] else 0
            for n, last_only in ((9, False), (9, True), (1, False)):
                if last_only and il != last:
                    continue
                kv = cpu.kv_layer(16, cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v, dtype, window)
                x = model.embed(np.zeros(n, np.int64))
                model.block(il, cpu, x, np.arange(n, dtype=np.int64), kv, last_only=last_only)
        if self.output_device == "cpu" and hasattr(model.output, "ggml_type"):
            w = model.output
            rows = cpu.kernels.bind(w.ggml_type, w.data[:8], w.n_cols)
            for n in (9, 1):
                h = np.zeros((n, cfg.n_embd), np.float32)
                cpu.rms_norm(h, model.output_norm, cfg.rms_eps, h)
                rows.matmul(h, np.empty((n, 8), np.float32))

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
    def kv_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d, kv in zip(self.layer_devices, self.kv):
            out[d] = out.get(d, 0) + kv.nbytes
        return out

    def reset(self) -> None:
        for kv in self.kv:
            kv.clear()
        self.n_past = 0

    def _step(self, ids: np.ndarray, all_logits: bool) -> np.ndarray:
        """Run n_tok ≤ n_batch tokens at positions n_past.. ; returns host logits (n_out, n_vocab)."""
        timing = self.timing
        pos = np.arange(self.n_past, self.n_past + len(ids), dtype=np.int64)
        t0 = time.perf_counter()
        x = self.model.embed(ids)
        cur = self.backends["cpu"]
        timing.add("cpu", time.perf_counter() - t0)
        last = len(self.model.layer_backends) - 1
        for il, b in enumerate(self.model.layer_backends):
            if b is not cur:
                x = self._cross(x, cur, b)
                cur = b
            t0 = time.perf_counter()
            self.model.block(il, b, x, pos, self.kv[il], last_only=not all_logits and il == last)
            b.synchronize()
            timing.add(b.device, time.perf_counter() - t0)
        ob = self.model.output_backend
        if ob is not cur:
            x = self._cross(x, cur, ob)
        t0 = time.perf_counter()
        rows = x if all_logits else x[-1:]
        logits = self.model.head(rows)
        timing.add(ob.device, time.perf_counter() - t0)
        self.n_past += len(ids)
        timing.tokens += len(ids)
        return logits

    def _cross(self, x, src, dst):
        t0 = time.perf_counter()
        y = dst.from_host(src.to_host(x))
        dst.synchronize()
        self.timing.add("transfer", time.perf_counter() - t0)
        return y

    def _check_room(self, n: int) -> None:
        if n == 0:
            raise InvalidArgumentError("no tokens to evaluate")
        if self.n_past + n > self.n_ctx:
            raise ContextFullError(
                f"context full: {self.n_past} tokens in context + {n} new > n_ctx {self.n_ctx}; "
                "start a new context (reset) or load with a larger n_ctx"
            )

    def eval(self, tokens) -> np.ndarray:
        """Append tokens (prefill in batches of n_batch); float32 (n_vocab,) logits after the last."""
        ids = self._ids(tokens)
        self._check_room(len(ids))
        logits = None
        for i in range(0, len(ids), self.n_batch):
            logits = self._step(ids[i : i + self.n_batch], all_logits=False)
        if len(ids) > 1 or self._decode_checks < 2:  # a kernel warm_up did not foresee
            self._decode_checks += len(ids) == 1
            self._release_compiler()
        return logits[-1]

    def logits(self, tokens) -> np.ndarray:
        """Fresh context; float32 (n_tok, n_vocab) logits at every position."""
        ids = self._ids(tokens)
        self.reset()
        self._check_room(len(ids))
        if len(ids) <= self.n_batch:  # one batch: its logits are the answer, no copy
            logits = self._step(ids, all_logits=True)
            self._release_compiler()
            return logits
        out = np.empty((len(ids), self.cfg.n_vocab), dtype=np.float32)
        for i in range(0, len(ids), self.n_batch):
            out[i : i + self.n_batch] = self._step(ids[i : i + self.n_batch], all_logits=True)
        self._release_compiler()
        return out

    def _ids(self, tokens) -> np.ndarray:
        ids = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= self.cfg.n_vocab)][0])
            raise InvalidArgumentError(f"token id {bad} is outside the vocabulary (0..{self.cfg.n_vocab - 1})")
        return ids
