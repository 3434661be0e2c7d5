"""Generation as a ladder: a sequence's sampled token ids → a stream of Chunks with text, finish reason
and stats → the public calls (`Model.submit`, `generate`, `chat`, `generate_batch`).

`SeqStream` turns one sequence's sampled tokens into Chunks (text never split inside a UTF-8
sequence, stop strings held back until they can be ruled out, EOS/EOT, max_tokens, the context's
end). `Request` is what a caller holds: an iterator of those Chunks fed by the engine thread
(edgellm/scheduler.py) through a queue, with `cancel()` and its `stats`.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Chunk:
    token: int
    text: str  # never a broken UTF-8 sequence; may be "" while text is held back for a stop string
    finish_reason: str | None = None  # "stop" (EOS/EOT or stop string), "length", or None
    logprob: float | None = None  # log-probability of `token` (when asked for: logprobs=k)
    top_logprobs: tuple = ()  # ((token, logprob), ...) the k most likely tokens at this step
    tool_calls: tuple = ()  # the last Chunk of a chat answer that called tools: edgellm.toolcalls.ToolCall


@dataclass
class Stats:
    """Figures of a request (and `Model.stats`: of the last call), updated while it runs."""

    ttft_s: float = 0.0  # time to first token: from submission to the first sampled token
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the KV cache (prefix reuse), not evaluated
    prompt_tps: float = 0.0  # evaluated prompt tokens per second of prefill
    prompt_ms: float = 0.0  # prefill time: admission to the first token
    gen_tokens: int = 0
    gen_tps: float = 0.0
    gen_ms: float = 0.0  # first token to the last
    tpot_ms: float = 0.0  # time per output token after the first
    queue_ms: float = 0.0  # waiting for a free sequence slot
    preemptions: int = 0  # times this request's KV was freed and recomputed (the pool ran out)
    finish_reason: str | None = None
    device_ms: dict[str, float] = field(default_factory=dict)  # decode ms per step per device
    crossings: int = 0  # copies of the activations between devices in a decode step
    memory: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> term -> bytes
    n_past: int = 0  # tokens in the sequence's context
    n_ctx: int = 0
    draft_n: int = 0  # speculative decoding: tokens proposed and verified (llama-server's names)
    draft_n_accepted: int = 0  # of those, the ones kept


class SeqStream:
    """Sampled tokens → Chunks for one sequence."""

    def __init__(self, tokenizer, stops, max_tokens: int, ignore_eos: bool, n_ctx: int):
        self.tokenizer = tokenizer
        self.decoder = tokenizer.stream_decoder()
        self.stops = [s for s in stops if s]
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.n_ctx = n_ctx
        self.pending = ""  # text held back while it could be the start of a stop string
        self.n = 0

    def push(self, tok: int, n_past: int) -> Chunk:
        """The chunk for sampled token `tok`, the sequence holding n_past tokens; a chunk with a
        finish_reason is the last."""
        self.n += 1
        if not self.ignore_eos and self.tokenizer.is_eog(tok):
            return Chunk(tok, self.pending + self.decoder.flush(), "stop")
        text = self.pending + self.decoder.push(tok)
        self.pending = ""
        if self.stops:
            text, self.pending, hit = split_stop(text, self.stops)
            if hit:
                return Chunk(tok, text, "stop")
        if self.n >= self.max_tokens or n_past >= self.n_ctx:
            return Chunk(tok, text + self.pending + self.decoder.flush(), "length")
        return Chunk(tok, text)


def split_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
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


def logprobs_of(logits: np.ndarray, tok: int, k: int) -> tuple[float, tuple]:
    """log-softmax of the logits at `tok`, and the k most likely (token, logprob) pairs."""
    z = logits.astype(np.float64)
    m = z.max()
    lse = m + np.log(np.exp(z - m).sum())
    top = ()
    if k > 0:
        idx = np.argpartition(-z, min(k, len(z) - 1))[:k]
        idx = idx[np.argsort(-z[idx], kind="stable")]
        top = tuple((int(i), float(z[i] - lse)) for i in idx)
    return float(z[tok] - lse), top


_END = object()


class Request:
    """One submitted prompt: iterate it for Chunks (as the engine produces them); `cancel()` (or
    closing / dropping the iterator) frees its sequence at once. `stats` fills in as it runs."""

    def __init__(self, engine, seq_state):
        self._engine = engine
        self._state = seq_state
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stats: Stats = seq_state.stats
        self.done = False
        # the caller waits in the engine's queue, which was empty when it began to (read the queue
        # before this flag: with no step running, both then hold)
        self.parked = False
        self._sink = None  # push mode (attach): the engine's thread hands items to it
        self._lock = threading.Lock()  # orders attach's hand-over against the engine's _put

    # --- the engine side ---------------------------------------------------------------------
    def _put(self, item) -> None:
        self.parked = False
        if self._sink is not None:
            self._push(item)
            return
        with self._lock:
            if self._sink is None:
                self._queue.put(item)
                return
            self._push(item)

    def _push(self, item, sink=None) -> None:
        sink = sink or self._sink
        if item is _END:
            self.done = True
            sink(None)
            return
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self.done = True
        sink(item)

    @property
    def attached(self) -> bool:
        """In push mode (attach): the engine hands this request's items to its sink."""
        return self._sink is not None

    def attach(self, sink) -> None:
        """Push mode, for a caller on an event loop (the server): the engine's thread calls
        sink(item) for each Chunk, an exception (the last item), or None when the request ends
        without a last Chunk (cancelled); nothing is queued and nobody iterates. Needs the engine
        stepping on a thread of its own (Engine.run_forever)."""
        if self._engine.dedicated is None:
            raise RuntimeError("Request.attach needs an engine thread (Engine.run_forever)")
        with self._lock:
            while True:  # what the engine produced before: first, in order
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._push(item, sink)
            self._sink = sink

    def _ready(self) -> bool:
        return not self._queue.empty()

    # --- the caller side -----------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if self.done:
            raise StopIteration
        while True:  # run the engine's steps in this thread while no other thread does
            try:
                item = self._queue.get_nowait()
                break
            except queue.Empty:
                pass
            dedicated = self._engine.dedicated
            if dedicated is not None and dedicated is not threading.current_thread():
                self.parked = True  # only the engine's next chunk wakes this caller (_put clears it)
                if not self._queue.empty():
                    self.parked = False
                    continue
                item = self._queue.get()  # a thread in Engine.run_forever makes every step
                break
            if not self._engine.drive(self):  # no work left for the engine: the chunk is on its way
                try:
                    item = self._queue.get(timeout=0.02)
                    break
                except queue.Empty:
                    continue
        if item is _END:
            self.done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self.done = True
            raise item
        if item.finish_reason is not None:
            self.done = True
        return item

    @property
    def finish_reason(self) -> str | None:
        return self.stats.finish_reason

    def text(self) -> str:
        """The whole completion (waits for the end)."""
        return "".join(c.text for c in self)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            self._engine.cancel(self._state)

    close = cancel

    def __del__(self):
        # no lock here: the cycle collector may run this in a thread that holds the engine's
        # locks; the flag alone is enough (every step drops cancelled sequences)
        if not self.done:
            self._state.cancelled = True


def now() -> float:
    return time.perf_counter()
