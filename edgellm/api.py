"""The public Python API: `edgellm.load(...)` returns a `Model`.

Generation runs on the model's engine (edgellm/scheduler.py: one thread, continuous batching of up
to n_seq sequences, prefix reuse from the paged KV cache); `submit` hands it a prompt and returns a
`Request` (an iterator of Chunks, edgellm/generate.py); `generate`, `chat` and `generate_batch` are
built on `submit` and may be called from several threads at once.
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Iterator

import numpy as np

from edgellm import sampling as _sampling
from edgellm.errors import ContextFullError, InvalidArgumentError
from edgellm.generate import Chunk, Request, SeqStream, Stats, split_stop as _split_stop  # noqa: F401
from edgellm.tokenizer import token_ids


def default_threads() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil cannot always tell physical cores
        n = None
    n = max(1, n or os.cpu_count() or 1)
    from edgellm.machine import idle_cores  # cores busy with other work: fewer threads

    idle = idle_cores()
    return n if idle is None else max(1, min(n, int(idle + 0.25)))


def _int_arg(name: str, value, lo: int = 1, hi: int = 2**31 - 1) -> int:
    """value as an int in [lo, hi], or an InvalidArgumentError naming the parameter."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value != value or int(value) != value \
            or not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be an integer in {lo}..{hi}, got {value!r}")
    return int(value)


def _real_arg(name: str, value) -> float:
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{name} must be a number, got {value!r}")
    return float(value)


SAMPLING_ARGS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed", "stop",
                 "ignore_eos", "cache_prompt", "logprobs")
GRAMMAR_ARGS = ("json_schema", "grammar", "regex", "response_format")
CHAT_ARGS = SAMPLING_ARGS + GRAMMAR_ARGS + ("tools", "tool_choice", "parallel_tool_calls")


def response_format_schema(rf):
    """OpenAI's response_format as a JSON schema: None for text, {"type": "object"} for
    json_object, the given schema for json_schema."""
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return rf.get("schema") or {"type": "object"}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if schema is None and isinstance(js, dict) and "name" not in js:
            schema = js  # llama-server also takes the schema itself here
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgumentError("response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                                       "\"schema\": {...}}}")
        return schema
    raise InvalidArgumentError("response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                               "{\"type\": \"json_schema\", \"json_schema\": {...}}")


def load(path=None, *, gpu_layers=0, n_ctx: int = 4096, n_batch: int = 512, threads: int | None = None,
         vram=None, kv_type: str = "f16", n_seq: int = 1, kv_size: int | None = None, policy: str = "continuous",
         quiet: bool = True, use_mmap: bool | None = None, spec_type: str = "none", spec_draft_n_max: int = 16,
         spec_draft_n_min: int = 0, spec_ngram_size_n: int = 3, spec_ngram_size_m: int = 16,
         flash_attn="off", batch_invariant: bool = False, draft=None, spec_draft_p_min: float = 0.75,
         tensor_overrides=(), cpu_moe: bool = False, n_cpu_moe: int = 0) -> "Model":
    """Load a GGUF model. path None → the default model (fetched on first use). gpu_layers: 0 | N |
    -1 (all) | "auto". vram: a GPU budget ("4GiB" or bytes) overriding what the device reports.
    n_seq: sequences decoded together (concurrent generate/chat/submit calls); n_ctx is each one's
    context. kv_size: the KV pool in tokens (default n_seq * n_ctx; smaller pools preempt).
    policy: "continuous" batching (default) or "static" (a batch ends when its longest member ends).
    use_mmap: True keeps the CPU layers' weights in the file mapping; False copies them into huge-page
    memory (faster decode: edgellm/resident.py); None (default) copies when the machine has
    transparent huge pages and the file takes under half the available memory.
    spec_type (llama.cpp's --spec-type): "none", "ngram-simple" (speculative decoding by prompt
    lookup: the tokens that followed the last earlier occurrence of the latest n-gram are verified
    in one step; the same tokens as plain decoding, faster on text that repeats its context) or
    "draft-simple" (a draft model's greedy tokens are verified; the default when `draft` is given).
    draft (-md/--model-draft): a smaller model with the target's vocabulary: a path, a known name
    or a loaded Model; loaded with the target's n_ctx, n_seq and threads, its own KV cache.
    spec_draft_n_max / _n_min: the most / fewest tokens proposed in a step; spec_draft_p_min: a
    draft stops proposing after a token it gives less probability; spec_ngram_size_n / _m: the
    longest n-gram looked up, the most tokens copied after it (--spec-ngram-simple-size-n/-m).
    flash_attn (llama.cpp's -fa): "off" (default: llama.cpp's KQ / softmax / V^T P graph, what
    llama-cpp-python runs by default), "on" (an f16 cache read as llama.cpp's CPU flash attention
    reads it: the bits of llama.cpp's tools, whose "auto" turns it on for the CPU; a one-token decode
    over 256 or more cached tokens (its split-KV kernel) then depends on `threads`, as llama.cpp's
    on -t), "auto" (= "on" here), or a bool; it changes the CPU layers only (a GPU layer's attention
    is unchanged). A q8_0 / q4_0 cache is always read by flash attention (llama.cpp needs it for a
    quantized V).
    batch_invariant: every sequence gets, bit for bit, the tokens it gets alone, whichever others
    share its steps (each prompt chunk in a pass of its own, decode tokens by as many as keep the
    one-token order); costs passes over the weights: K-quant files decoding 8+ sequences run two
    (docs/performance.md). Off: one pass a step, each decode token still the bits it gets alone
    up to 7 (K-quants) or 16 (legacy types) sequences and without a prompt in the same step.
    tensor_overrides (llama.cpp's -ot): ["REGEX=DEVICE" | (regex, device), ...], DEVICE "cpu" or
    "cuda0": the first rule whose regex is found in a tensor's name places it; edgellm places a
    mixture-of-experts layer's expert tensors (ffn_*_exps) this way. cpu_moe (--cpu-moe): every
    layer's experts on the CPU; n_cpu_moe (--n-cpu-moe): the experts of the first n_cpu_moe layers
    (a warning, not an error, on a model without experts)."""
    from edgellm.config import ModelConfig
    from edgellm.fetch import resolve_model
    from edgellm.gguf_file import GGUFFile

    import os as _os

    if path is not None and not isinstance(path, (str, _os.PathLike)):
        raise InvalidArgumentError(f"path must be a file path or a known model name, got {type(path).__name__}")
    if threads is not None:
        threads = _int_arg("threads", threads, 1, 1024)
    n_ctx, n_batch = _int_arg("n_ctx", n_ctx), _int_arg("n_batch", n_batch)
    n_seq = _int_arg("n_seq (sequences decoded together)", n_seq, 1, 4096)
    if kv_size is not None:
        kv_size = _int_arg("kv_size (tokens in the KV pool)", kv_size)
    if gpu_layers != "auto":
        gpu_layers = _int_arg("gpu_layers (N, -1 for all, or 'auto')", gpu_layers, -1, 1 << 20)
    from edgellm.kv_cache import kv_type as _check_kv_type
    from edgellm.scheduler import POLICIES

    _check_kv_type(kv_type)
    flash_attn = flash_attn_arg(flash_attn, kv_type)
    if draft is not None and spec_type == "none":
        spec_type = "draft-simple"
    spec = spec_params(spec_type, spec_draft_n_max, spec_draft_n_min, spec_ngram_size_n, spec_ngram_size_m,
                       spec_draft_p_min)
    if spec.spec_type == "draft-simple" and draft is None:
        raise InvalidArgumentError("spec type 'draft-simple' needs a draft model: draft= (-md/--model-draft)")
    if draft is not None and spec.spec_type != "draft-simple":
        raise InvalidArgumentError(f"a draft model drafts with spec type 'draft-simple', not {spec.spec_type!r}")
    if draft is not None and not isinstance(draft, (str, _os.PathLike, Model)):
        raise InvalidArgumentError(f"draft must be a file path, a known model name or a Model, "
                                   f"got {type(draft).__name__}")
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    if use_mmap is not None and not isinstance(use_mmap, bool):
        raise InvalidArgumentError(f"use_mmap must be True, False or None, not {use_mmap!r}")
    file = resolve_model(path, quiet=quiet)
    gf = GGUFFile(file)
    if use_mmap is None:
        from edgellm.resident import want_resident

        use_mmap = not want_resident(gf.file_size)
    cfg = ModelConfig.from_gguf(gf)
    from edgellm.placement import tensor_overrides as _overrides

    rules = _overrides(tensor_overrides, cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe)
    if (cpu_moe or n_cpu_moe) and "n_expert" not in cfg.extra and not quiet:
        import sys

        flag = "--cpu-moe" if cpu_moe else "--n-cpu-moe"
        print(f"edgellm: warning: {flag}: {gf.path.name} has no mixture-of-experts layers; ignored", file=sys.stderr)
    draft_model, owned = draft, False
    if isinstance(draft, (str, _os.PathLike)):  # loaded first: a draft that fails leaves nothing behind
        from edgellm.speculative import check_draft
        from edgellm.tokenizer import Tokenizer

        dgf = GGUFFile(resolve_model(draft, quiet=quiet))
        check_draft((Tokenizer.from_metadata(gf.metadata), gf), (Tokenizer.from_metadata(dgf.metadata), dgf))
        draft_model, owned = load(draft, n_ctx=n_ctx, n_batch=n_batch, threads=threads, kv_type=kv_type,
                                  n_seq=n_seq, kv_size=kv_size, quiet=quiet, use_mmap=use_mmap,
                                  flash_attn=flash_attn), True
    try:
        model = Model(gf, cfg, gpu_layers=gpu_layers, n_ctx=int(n_ctx), n_batch=int(n_batch),
                      threads=threads or default_threads(), vram=vram, kv_type=kv_type, n_seq=int(n_seq),
                      kv_size=None if kv_size is None else int(kv_size), policy=policy, quiet=quiet,
                      use_mmap=use_mmap, spec=spec, flash_attn=flash_attn, batch_invariant=bool(batch_invariant),
                      draft=draft_model, overrides=rules)
    except BaseException:
        if owned:
            draft_model.close()
        raise
    model._owns_draft = owned
    return model


def flash_attn_arg(value, kv_type: str = "f16") -> bool:
    """load()'s flash_attn ("on", "off", "auto" or a bool; llama.cpp's -fa) as a bool: "auto" is
    llama.cpp's CPU choice, on. On needs an f16 or quantized cache."""
    if isinstance(value, bool):
        on = value
    elif isinstance(value, str) and value.lower() in ("on", "off", "auto"):
        on = value.lower() != "off"
    else:
        raise InvalidArgumentError(f"flash_attn (-fa/--flash-attn) must be 'on', 'off', 'auto' or a bool, "
                                   f"not {value!r}")
    if on and kv_type == "f32":
        raise InvalidArgumentError("flash_attn='on' reads an f16 or quantized KV cache, not f32; use kv_type='f16' "
                                   "or flash_attn='off'")
    return on


def spec_params(spec_type, n_max, n_min, ngram_n, ngram_m, p_min=0.75):
    """load()'s speculative decoding settings as a SpecParams, or an InvalidArgumentError."""
    from edgellm.speculative import SPEC_TYPES, SpecParams

    if not isinstance(spec_type, str) or spec_type not in SPEC_TYPES:
        raise InvalidArgumentError(f"spec_type (--spec-type) must be one of {', '.join(SPEC_TYPES)}, "
                                   f"not {spec_type!r}")
    if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
        raise InvalidArgumentError(f"spec_draft_p_min (--spec-draft-p-min) must be a number in [0, 1], not {p_min!r}")
    return SpecParams(spec_type=spec_type, p_min=float(p_min),
                      n_max=_int_arg("the draft length spec_draft_n_max (--spec-draft-n-max)", n_max, 1, 1 << 16),
                      n_min=_int_arg("spec_draft_n_min (--spec-draft-n-min)", n_min, 0, 1 << 16),
                      ngram_n=_int_arg("spec_ngram_size_n (--spec-ngram-simple-size-n)", ngram_n, 1, 1 << 16),
                      ngram_m=_int_arg("spec_ngram_size_m (--spec-ngram-simple-size-m)", ngram_m, 1, 1 << 16))


def _grammar_kwargs(kw: dict) -> dict:
    unknown = sorted(set(kw) - set(GRAMMAR_ARGS) - {"logprobs"})
    if unknown:
        raise InvalidArgumentError(f"got an unknown argument {unknown[0]!r}")
    return kw


class _CompileReport:
    """"compiling kernels (first run only)" on stderr: one line, redrawn on a terminal, with the
    kernels compiled so far and the seconds spent (see edgellm.precompile.CompileProgress). Silent
    when every kernel comes from the disk cache."""

    def __new__(cls, stream=None):
        from edgellm.precompile import CompileProgress

        return CompileProgress(stream)


class Model:
    def __init__(self, gf, cfg, *, gpu_layers, n_ctx, n_batch, threads, vram, kv_type, backends=None,
                 n_seq: int = 1, kv_size: int | None = None, policy: str = "continuous", quiet: bool = True,
                 use_mmap: bool = True, spec=None, flash_attn: bool = False, batch_invariant: bool = False,
                 draft: Model | None = None, overrides=()):
        from edgellm.kernels.cpu.backend import CPUBackend
        from edgellm.placement import make_plan
        from edgellm.runtime import Runtime
        from edgellm.scheduler import Engine
        from edgellm.tokenizer import Tokenizer

        self.gf = gf
        self.config = cfg
        self.path = gf.path
        self.metadata = gf.metadata
        self.n_vocab = cfg.n_vocab
        self.n_ctx = n_ctx
        self.n_batch = min(n_batch, n_ctx)
        self.n_seq = n_seq
        self.threads = threads
        self.flash_attn = flash_attn
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.draft = draft  # the draft model (speculative decoding), checked before any weight is read
        self._owns_draft = False
        if draft is not None:
            from edgellm.speculative import check_draft

            check_draft(self, draft)
        self.plan = make_plan(gf, cfg, gpu_layers=gpu_layers, n_ctx=n_ctx, n_batch=self.n_batch,
                              kv_type=kv_type, vram=vram, n_seq=n_seq, kv_size=kv_size, overrides=overrides,
                              draft=draft.plan if draft is not None else None)
        if backends is None:
            backends = {"cpu": CPUBackend(threads, resident=not use_mmap, flash_attn=flash_attn)}
            if self.plan.n_gpu_layers > 0 or self.plan.output_device == "gpu" or "gpu" in self.plan.experts:
                from edgellm.kernels.cuda import require

                require()
                from edgellm.kernels.cuda.backend import CudaBackend

                backends["gpu"] = CudaBackend()
        report = None if quiet else _CompileReport()
        self.runtime = Runtime(gf, cfg, self.plan, backends, on_compile=report)
        if report is not None:
            report.done()
        self._lock = threading.RLock()  # one forward step at a time: the engine's or eval/logits'
        drafter = None
        if draft is not None:
            from edgellm.speculative import DraftModel

            drafter = DraftModel(draft.runtime, n_vocab=self.n_vocab, n_batch=draft.n_batch, n_max=spec.n_max,
                                 p_min=spec.p_min, lock=draft._lock)
            drafter.size_ratio = draft.gf.file_size / gf.file_size
        self.engine = Engine(self.runtime, self.tokenizer, n_seq=n_seq, n_batch=self.n_batch, n_ctx=n_ctx,
                             policy=policy, lock=self._lock, spec=spec, batch_invariant=batch_invariant,
                             draft=drafter)
        self.stats = Stats(n_ctx=n_ctx)
        self.stats.memory = self.memory()
        from edgellm.grammar import VocabularyCache

        self.grammar_vocab = VocabularyCache(self.tokenizer)  # llguidance's tokens, built on first use

    # --- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"tokenize() takes a str, not {type(text).__name__}")
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.detokenize(token_ids(tokens, self.n_vocab))

    # --- evaluation -----------------------------------------------------------------------
    def reset(self) -> None:
        with self._lock:
            self.runtime.reset()
        self.stats.n_past = 0

    def eval(self, tokens) -> np.ndarray:
        with self._lock:
            out = self.runtime.eval(tokens)
        self.stats.n_past = self.runtime.n_past
        return out

    def logits(self, tokens, first: int = 0) -> np.ndarray:
        """float32 (len(tokens) - first, n_vocab): a fresh context's logits at every position from
        `first` on (earlier rows skip the output head: cheaper with a large vocabulary)."""
        with self._lock:
            out = self.runtime.logits(tokens, first)
        self.stats.n_past = self.runtime.n_past
        return out

    @property
    def n_past(self) -> int:
        return self.runtime.n_past

    # --- generation -----------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            try:  # a prompt that cannot fit fails without being tokenized in full (one BOS may go below)
                ids = self.tokenizer.tokenize(prompt, add_special=True, parse_special=True, limit=self.n_ctx)
            except ContextFullError:
                raise ContextFullError(
                    f"the prompt is more than {self.n_ctx} tokens but the context holds {self.n_ctx}; "
                    "shorten the prompt or load with a larger n_ctx (-c)") from None
            bos = self.tokenizer.bos_id
            if len(ids) >= 2 and bos is not None and ids[0] == bos and ids[1] == bos:
                ids = ids[1:]  # a template that writes BOS itself
        elif prompt is None or isinstance(prompt, bytes):
            raise InvalidArgumentError("the prompt must be a str or a list of token ids")
        else:
            if isinstance(prompt, (list, tuple)) and len(prompt) >= self.n_ctx:  # before checking each id
                raise ContextFullError(f"the prompt is {len(prompt)} tokens but the context holds {self.n_ctx}; "
                                       "shorten the prompt or load with a larger n_ctx (-c)")
            ids = token_ids(prompt, self.n_vocab, "a prompt of token ids")
        if not ids:
            raise InvalidArgumentError("the prompt is empty")
        return ids

    def submit(self, prompt, *, max_tokens: int = _sampling.MAX_TOKENS, temperature: float = _sampling.TEMPERATURE,
               top_k: int = _sampling.TOP_K, top_p: float = _sampling.TOP_P, min_p: float = _sampling.MIN_P,
               repeat_penalty: float = _sampling.REPEAT_PENALTY, seed: int | None = None,
               stop: Iterable[str] = (), ignore_eos: bool = False, logprobs: int | None = None,
               cache_prompt: bool = True, json_schema=None, grammar: str | None = None, regex: str | None = None,
               response_format=None, constraint=None) -> Request:
        """Queue `prompt` (str or token ids) on the engine; returns a Request: an iterator of Chunks,
        with .cancel() and .stats. Thread-safe; concurrent requests are decoded together.
        logprobs=k: every Chunk carries the sampled token's logprob and the k most likely.
        cache_prompt (llama-server's name): take the longest cached prefix of the prompt from the KV
        cache; False evaluates the whole prompt, as a fresh context does (the same bits as
        llama.cpp on a fresh context; a reused prefix changes the batch the rest is evaluated in).
        json_schema / grammar (GBNF) / regex / response_format (OpenAI's): the answer follows it
        (one of them; edgellm/grammar.py)."""
        from edgellm.sampling import Sampler, SamplingParams

        params = SamplingParams(temperature=_real_arg("temperature", temperature), top_k=_int_arg("top_k", top_k, 0),
                                top_p=_real_arg("top_p", top_p), min_p=_real_arg("min_p", min_p),
                                repeat_penalty=_real_arg("repeat_penalty", repeat_penalty),
                                seed=None if seed is None else _int_arg("seed", seed, 0, 2**63 - 1))
        max_tokens = _int_arg("max_tokens", max_tokens, 0)
        if logprobs is not None:
            logprobs = _int_arg("logprobs", logprobs, 0, 20)
        if stop is None:
            stop = ()
        if isinstance(stop, str):
            stop = [stop]  # one stop string (not its characters)
        stop = list(stop) if hasattr(stop, "__iter__") else [stop]
        if not all(isinstance(x, str) for x in stop):
            raise InvalidArgumentError(f"stop must be a string or a list of strings, got {stop!r}")
        if constraint is None:
            constraint = self.constraint(json_schema=json_schema, grammar=grammar, regex=regex,
                                         response_format=response_format)
        elif any(v is not None for v in (json_schema, grammar, regex, response_format)):
            raise InvalidArgumentError("a request takes one grammar")
        ids = self._prompt_ids(prompt)
        seq = self.runtime.seq  # the step lock only when eval()'s context holds blocks: a submit
        if seq is not None and (seq.n_past or any(seq.tables)):  # does not wait for a step
            with self._lock:  # eval()'s context gives its blocks back (they stay cached for reuse)
                self.runtime.reset()
        stream = SeqStream(self.tokenizer, list(stop), int(max_tokens), ignore_eos, self.n_ctx)
        req = self.engine.submit(ids, Sampler(params, constraint), stream, logprobs, cache_prompt=bool(cache_prompt))
        req.stats.memory = self.stats.memory
        if max_tokens == 0:
            req.cancel()
        return req

    def constraint(self, *, json_schema=None, grammar=None, regex=None, response_format=None):
        """A fresh grammar Constraint for one request, or None when none is asked for."""
        from edgellm.grammar import Constraint, grammar_text

        rf = response_format_schema(response_format)
        if rf is not None and json_schema is not None:
            raise InvalidArgumentError("give response_format or json_schema, not both")
        if all(v is None for v in (json_schema, rf, grammar, regex)):
            return None
        vocab = self.grammar_vocab.get()
        text = grammar_text(vocab, json_schema=json_schema if rf is None else rf, grammar=grammar, regex=regex)
        return Constraint(vocab, text)

    def generate(self, prompt, *, max_tokens: int = _sampling.MAX_TOKENS, temperature: float = _sampling.TEMPERATURE,
                 top_k: int = _sampling.TOP_K, top_p: float = _sampling.TOP_P, min_p: float = _sampling.MIN_P,
                 repeat_penalty: float = _sampling.REPEAT_PENALTY, seed: int | None = None,
                 stop: Iterable[str] = (), ignore_eos: bool = False, cache_prompt: bool = True,
                 **grammar) -> Iterator[Chunk]:
        """Complete `prompt` (str or token ids), streaming Chunks; `stats` follows this call. The
        longest cached prefix of the prompt is reused (a chat's earlier turns are not recomputed;
        cache_prompt=False evaluates it all). Breaking out of the loop frees the sequence."""
        req = self.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          min_p=min_p, repeat_penalty=repeat_penalty, seed=seed, stop=stop, ignore_eos=ignore_eos,
                          cache_prompt=cache_prompt, **_grammar_kwargs(grammar))
        self.stats = req.stats
        return self._follow(req)

    @staticmethod
    def _follow(req: Request) -> Iterator[Chunk]:
        try:
            yield from req
        finally:
            req.cancel()

    def generate_batch(self, prompts, **sampling) -> list[str]:
        """Complete every prompt (decoded together, up to n_seq at a time); the texts in order."""
        reqs = [self.submit(p, **sampling) for p in prompts]
        try:
            return [r.text() for r in reqs]
        finally:
            for r in reqs:
                r.cancel()

    def weights_read_per_token(self) -> dict[str, int]:
        """Bytes of weights one decode step reads on each device: the blocks placed there, and the
        output norm and head on the output device (the token embeddings are looked up, one row)."""
        return self.runtime.weights_read_per_token()

    def engine_stats(self) -> dict:
        """Sequences running / waiting, KV blocks total / used / cached / free, preemptions, token
        totals (the server's /metrics)."""
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine thread (requests in flight end), and a draft model loaded with this one."""
        self.engine.close()
        if self._owns_draft and self.draft is not None:
            self.draft.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def chat(self, messages, **kwargs) -> Iterator[Chunk]:
        """Render `messages` with the file's chat template (ChatML if it has none) and stream the
        reply. Takes the sampling arguments, a grammar (json_schema, grammar, regex,
        response_format) and OpenAI's tools / tool_choice / parallel_tool_calls: the last Chunk
        of an answer that calls tools carries them (`Chunk.tool_calls`, finish_reason
        "tool_calls"). `submit_chat` returns the request itself."""
        req = self.submit_chat(messages, **kwargs)
        self.stats = req.stats
        return self._follow(req)

    def submit_chat(self, messages, *, tools=None, tool_choice=None, parallel_tool_calls=None, **kwargs):
        """Queue a chat; returns an edgellm.toolcalls.ChatRequest (Chunks, `tool_calls`, `text()`,
        `stats`, `cancel()`)."""
        from edgellm import toolcalls as tc

        unknown = sorted(set(kwargs) - set(SAMPLING_ARGS + GRAMMAR_ARGS))
        if unknown:
            raise InvalidArgumentError(f"chat() got an unknown argument {unknown[0]!r}; it takes "
                                       f"{', '.join(CHAT_ARGS)}")
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidArgumentError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}")
        messages = list(messages) if isinstance(messages, (list, tuple)) else messages
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError("messages must be a non-empty list of {'role', 'content'} dicts")
        tools = tc.check_tools(tools)
        choice = tc.check_tool_choice(tool_choice, tools)
        if not tools or choice == "none":
            prompt = self.render_chat(messages, tools=tools or None)
            return tc.ChatRequest(self.submit(prompt, **kwargs), self.tokenizer, None, [], False)
        if any(kwargs.get(k) is not None for k in GRAMMAR_ARGS):
            raise InvalidArgumentError("tools and a grammar (json_schema, grammar, regex, response_format) "
                                       "cannot be combined")
        parallel = bool(parallel_tool_calls) if parallel_tool_calls is not None else False
        fmt = self.call_format()
        msgs = tc.template_messages(messages, fmt)
        if fmt is tc.GENERIC:
            note = tc.generic_system_text(tools, choice, parallel)
            if msgs[0].get("role") == "system":
                msgs[0] = {**msgs[0], "content": f"{msgs[0]['content']}\n\n{note}"}
            else:
                msgs.insert(0, {"role": "system", "content": note})
            prompt = self.render_chat(msgs)
        else:
            prompt = self.render_chat(msgs, tools=tools)
        from edgellm.grammar import Constraint, check_grammar

        vocab = self.grammar_vocab.get()
        text, triggers = tc.call_grammar(vocab, fmt, tools, choice, parallel)
        check_grammar(vocab, text, "tools")
        constraint = Constraint(vocab, text, triggers)
        req = self.submit(prompt, constraint=constraint, **kwargs)
        return tc.ChatRequest(req, self.tokenizer, fmt, tools, holding=not triggers, triggers=triggers)

    def call_format(self):
        """The tool-call format of this file's chat template (edgellm.toolcalls)."""
        from edgellm import toolcalls as tc

        probe = [{"role": "user", "content": "x"}]
        tool = [{"type": "function", "function": {"name": "probe_tool", "description": "", "parameters": {}}}]
        renders = "probe_tool" in self.render_chat(probe, tools=tool)
        return tc.detect_format(self.metadata.get("tokenizer.chat_template"), renders)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None) -> str:
        """Prompt text of `messages` (tool calls and results included, as llama-server renders
        them) with the file's chat template."""
        from edgellm import toolcalls as tc
        from edgellm.chat import render_chat

        tk = self.tokenizer
        extra = {"tools": tc.check_tools(tools)} if tools else {}
        return render_chat(self.metadata.get("tokenizer.chat_template"),
                           tc.template_messages(list(messages), tc.FORMATS[0]),
                           bos_token=tk.token_text(tk.bos_id) if tk.bos_id is not None else "",
                           eos_token=tk.token_text(tk.eos_id) if tk.eos_id is not None else "",
                           add_generation_prompt=add_generation_prompt, **extra)

    # --- memory ---------------------------------------------------------------------------
    def memory(self) -> dict[str, dict[str, int]]:
        """Bytes per device per ledger term, as allocated (weights placed, KV cache arrays)."""
        from edgellm.placement import measured_memory

        return measured_memory(self)

    def __repr__(self) -> str:
        return (f"<edgellm.Model {self.config.arch} '{self.config.name}' n_ctx={self.n_ctx} "
                f"gpu_layers={self.plan.n_gpu_layers}>")


