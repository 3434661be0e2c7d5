"""The public Python API: `edgellm.load(...)` returns a `Model`.

Generation is a ladder of generators: `_generate_tokens` (sample one token per decode step) →
`generate` (text chunks that never split a UTF-8 sequence, stop strings, stats) → `chat`.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import numpy as np

from edgellm.errors import ContextFullError, InvalidArgumentError


@dataclass(frozen=True)
class Chunk:
    token: int
    text: str  # never a broken UTF-8 sequence; may be "" while text is held back for a stop string
    finish_reason: str | None = None  # "stop" (EOS/EOT or stop string), "length", or None


@dataclass
class Stats:
    """Figures of the last call, updated while it runs."""

    ttft_s: float = 0.0  # time to first token (prefill + first sample)
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    gen_tokens: int = 0
    gen_tps: float = 0.0
    tpot_ms: float = 0.0  # time per output token after the first
    device_ms: dict[str, float] = field(default_factory=dict)  # decode ms per token per device
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> term -> bytes
    n_past: int = 0  # tokens in the context
    n_ctx: int = 0


def default_threads() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil cannot always tell physical cores
        n = None
    n = max(1, n or os.cpu_count() or 1)
    from edgellm.kernels.cpu import idle_cores  # cores busy with other work: fewer threads

    idle = idle_cores()
    return n if idle is None else max(1, min(n, int(idle + 0.25)))


def load(path=None, *, gpu_layers=0, n_ctx: int = 4096, n_batch: int = 512, threads: int | None = None,
         vram=None, kv_type: str = "f16", quiet: bool = True) -> "Model":
    """Load a GGUF model. path None → the default model (fetched on first use). gpu_layers: 0 | N |
    -1 (all) | "auto". vram: a GPU budget ("4GiB" or bytes) overriding what the device reports."""
    from edgellm.config import ModelConfig
    from edgellm.fetch import resolve_model
    from edgellm.gguf_file import GGUFFile

    if threads is not None and (int(threads) != threads or threads < 1):
        raise InvalidArgumentError(f"threads must be an integer >= 1, got {threads}")
    if int(n_ctx) != n_ctx or n_ctx < 1 or int(n_batch) != n_batch or n_batch < 1:
        raise InvalidArgumentError(f"n_ctx and n_batch must be integers >= 1 (got {n_ctx}, {n_batch})")
    file = resolve_model(path, quiet=quiet)
    gf = GGUFFile(file)
    cfg = ModelConfig.from_gguf(gf)
    return Model(gf, cfg, gpu_layers=gpu_layers, n_ctx=int(n_ctx), n_batch=int(n_batch),
                 threads=threads or default_threads(), vram=vram, kv_type=kv_type, quiet=quiet)


class _CompileReport:
    """"compiling kernels (first run only)" on stderr with a count and the kernel at work, as the
    first run of an install compiles them (on a terminal one line, redrawn; otherwise a line per
    kernel). Silent when every kernel comes from the disk cache."""

    def __init__(self, stream=None):
        import sys

        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.count = 0
        self.t0 = time.perf_counter()

    def __call__(self, name: str) -> None:
        self.count += 1
        line = f"compiling kernels (first run only): {self.count} {name}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.count:
            end = "\r\033[K" if self.tty else ""
            self.stream.write(f"{end}compiled {self.count} kernels in {time.perf_counter() - self.t0:.0f} s "
                              "(cached for the next runs)\n")
            self.stream.flush()


class Model:
    def __init__(self, gf, cfg, *, gpu_layers, n_ctx, n_batch, threads, vram, kv_type, backends=None,
                 quiet: bool = True):
        from edgellm.backend_cpu import CPUBackend
        from edgellm.placement import make_plan
        from edgellm.runtime import Runtime
        from edgellm.tokenizer import Tokenizer

        self.gf = gf
        self.config = cfg
        self.path = gf.path
        self.metadata = gf.metadata
        self.n_vocab = cfg.n_vocab
        self.n_ctx = n_ctx
        self.n_batch = min(n_batch, n_ctx)
        self.threads = threads
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.plan = make_plan(gf, cfg, gpu_layers=gpu_layers, n_ctx=n_ctx, n_batch=self.n_batch,
                              kv_type=kv_type, vram=vram)
        if backends is None:
            backends = {"cpu": CPUBackend(threads)}
            if self.plan.n_gpu_layers > 0 or self.plan.output_device == "gpu":
                from edgellm.kernels.cuda import require

                require()
                from edgellm.kernels.cuda.backend import CudaBackend

                backends["gpu"] = CudaBackend()
        report = None if quiet else _CompileReport()
        self.runtime = Runtime(gf, cfg, layer_devices=self.plan.layers, output_device=self.plan.output_device,
                               backends=backends, n_ctx=n_ctx, n_batch=self.n_batch, kv_type=kv_type,
                               on_compile=report)
        if report is not None:
            report.done()
        self.stats = Stats(n_ctx=n_ctx)
        self.stats.memory = self.memory()

    # --- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"tokenize() takes a str, not {type(text).__name__}")
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.detokenize(list(tokens))

    # --- evaluation -----------------------------------------------------------------------
    def reset(self) -> None:
        self.runtime.reset()
        self.stats.n_past = 0

    def eval(self, tokens) -> np.ndarray:
        out = self.runtime.eval(tokens)
        self.stats.n_past = self.runtime.n_past
        return out

    def logits(self, tokens) -> np.ndarray:
        out = self.runtime.logits(tokens)
        self.stats.n_past = self.runtime.n_past
        return out

    @property
    def n_past(self) -> int:
        return self.runtime.n_past

    # --- generation -----------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_special=True, parse_special=True)
            bos = self.tokenizer.bos_id
            if len(ids) >= 2 and bos is not None and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]  # a template that writes BOS itself
            return ids
        ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidArgumentError("the prompt is empty")
        return ids

    def generate(self, prompt, *, max_tokens: int = 256, temperature: float = 0.8, top_k: int = 40,
                 top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, seed: int | None = None,
                 stop: Iterable[str] = (), ignore_eos: bool = False) -> Iterator[Chunk]:
        """Complete `prompt` (str or token ids) in a fresh context, streaming Chunks."""
        from edgellm.sampling import Sampler, SamplingParams

        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed)
        if int(max_tokens) != max_tokens or max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be an integer >= 0, got {max_tokens}")
        ids = self._prompt_ids(prompt)
        if len(ids) >= self.n_ctx:
            raise ContextFullError(
                f"the prompt is {len(ids)} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or load with a larger n_ctx (-c)"
            )
        stops = [s for s in stop if s]
        return self._stream(ids, Sampler(params), int(max_tokens), stops, ignore_eos)

    def _stream(self, ids, sampler, max_tokens, stops, ignore_eos) -> Iterator[Chunk]:
        stats = self.stats = Stats(n_ctx=self.n_ctx, memory=self.stats.memory)
        decoder = self.tokenizer.stream_decoder()
        history = list(ids)
        pending = ""  # text held back while it could be the start of a stop string
        t_start = time.perf_counter()
        self.reset()
        logits = self.eval(ids)
        t_prompt = time.perf_counter()
        stats.prompt_tokens = len(ids)
        stats.prompt_tps = len(ids) / max(t_prompt - t_start, 1e-9)
        self.runtime.timing.seconds.clear()
        self.runtime.timing.tokens = 0
        n = 0
        while n < max_tokens:
            tok = sampler(logits, history)
            n += 1
            now = time.perf_counter()
            if n == 1:
                stats.ttft_s = now - t_start
                t_first = now
            stats.gen_tokens = n
            if n > 1:
                stats.tpot_ms = 1000 * (now - t_first) / (n - 1)
                stats.gen_tps = (n - 1) / max(now - t_first, 1e-9)
            timing = self.runtime.timing
            if timing.tokens:
                stats.device_ms = {d: 1000 * s / timing.tokens for d, s in timing.seconds.items()}
            if not ignore_eos and self.tokenizer.is_eog(tok):
                yield Chunk(tok, pending + decoder.flush(), "stop")
                return
            history.append(tok)
            text = pending + decoder.push(tok)
            pending = ""
            if stops:
                text, pending, hit = _split_stop(text, stops)
                if hit:
                    yield Chunk(tok, text, "stop")
                    return
            last = n == max_tokens or self.runtime.n_past >= self.n_ctx
            if last:
                yield Chunk(tok, text + pending + decoder.flush(), "length")
                return
            yield Chunk(tok, text)
            logits = self.eval([tok])
            stats.n_past = self.runtime.n_past

    def chat(self, messages, **sampling) -> Iterator[Chunk]:
        """Render `messages` with the file's chat template (ChatML if it has none) and stream the reply."""
        prompt = self.render_chat(messages)
        return self.generate(prompt, **sampling)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        from edgellm.chat import render_chat

        tk = self.tokenizer
        return render_chat(self.metadata.get("tokenizer.chat_template"), list(messages),
                           bos_token=tk.token_text(tk.bos_id) if tk.bos_id is not None else "",
                           eos_token=tk.token_text(tk.eos_id) if tk.eos_id is not None else "",
                           add_generation_prompt=add_generation_prompt)

    # --- memory ---------------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes per device per ledger term, as allocated (weights placed, KV cache arrays)."""
        from edgellm.placement import measured_memory

        return measured_memory(self)

    def __repr__(self) -> str:
        return (f"<edgellm.Model {self.config.arch} '{self.config.name}' n_ctx={self.n_ctx} "
                f"gpu_layers={self.plan.n_gpu_layers}>")


def _split_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text to emit, text to hold back, stop hit)."""
    for s in stops:
        i = text.find(s)
        if i >= 0:
            return text[:i], "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return (text[: len(text) - hold], text[len(text) - hold :], False) if hold else (text, "", False)
