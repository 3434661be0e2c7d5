"""The model behind the server, seen from the event loop (`ModelHost`).

The model loads on a thread of its own (the server answers /health with 503 meanwhile), which then
runs every engine step (Engine.run_forever). A request is rendered, tokenized and submitted on a
small pool of threads (the event loop never touches the model), then attached to the engine in push
mode (Request.attach): the engine's thread hands each Chunk to the request's Stream through the
event loop's call_soon_threadsafe, with no thread per request; the Chunk is what the SSE encoder reads. `Stream.cancel()` (a closed
connection) reaches the engine at once through `Request.cancel()`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

from edgellm.serve.protocol import APIError


_END = object()


class Stream:
    """Chunks of one request, from the engine's thread to the event loop."""

    def __init__(self, engine: "ModelHost", loop: asyncio.AbstractEventLoop, want_logprobs: bool = False):
        self.engine = engine
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request = None
        self.stats = None
        self.want_logprobs = want_logprobs
        self.cancelled = threading.Event()
        self.aborted = False  # ended by the server (shutting down), not by the client or the engine
        self.reported = False  # counted in the metrics (once, whichever way it ended)
        self.ended = False  # the engine is done with it (the last item arrived)
        self.t_start = time.perf_counter()
        self.t_last = None  # when the Chunk next() returned last reached the server (perf_counter)

    def attach(self, req) -> None:
        """Take the submitted request's items from the engine's thread (push mode)."""
        self.request = req
        self.stats = req.stats
        if self.cancelled.is_set():  # cancelled while submit ran
            req.cancel()
        req.attach(self._from_engine)

    def _from_engine(self, item) -> None:
        """The engine's thread: hand the item to the event loop (nothing else here)."""
        try:
            self.loop.call_soon_threadsafe(self._arrive, item, time.perf_counter())
        except RuntimeError:  # the loop is closed (the server has stopped): nobody reads it
            pass

    def _arrive(self, item, t: float) -> None:
        """The event loop: queue the Chunk with its arrival time; the last item ends the stream."""
        if item is None or isinstance(item, BaseException):
            if item is not None:
                self.queue.put_nowait((item, t))
            self._end()
            return
        self.queue.put_nowait((item, t))
        if item.finish_reason is not None:
            self._end()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self.queue.put_nowait(_END)
            self.engine._done(self)

    def cancel(self) -> None:
        """Stop generating now: the engine frees the sequence's slot and blocks."""
        self.cancelled.set()
        if self.request is not None:
            self.request.cancel()

    def abort(self) -> None:
        """End the request because the server stops: the client is told so instead of a finish."""
        self.aborted = True
        self.cancel()

    async def next(self, timeout: float | None = None):
        """The next Chunk (its arrival time in t_last), None at the end, or TimeoutError after
        `timeout` seconds without one."""
        got = await asyncio.wait_for(self.queue.get(), timeout)
        if got is _END:
            return None
        item, t = got
        if isinstance(item, BaseException):
            raise map_error(item)
        self.t_last = t
        return item

    def logprob_entry(self, chunk):
        """(token text, logprob, ((text, logprob), ...)) for the response's logprobs, or None when
        none were asked for or the token ends the generation (left out, as llama-server does)."""
        tk = self.engine.model.tokenizer
        if not self.want_logprobs or tk.is_eog(chunk.token):
            return None
        if chunk.logprob is None:
            return "", None, ()
        return (_token_text(tk, chunk.token), float(chunk.logprob),
                tuple((_token_text(tk, i), float(lp)) for i, lp in chunk.top_logprobs))


def _token_text(tk, tok: int) -> str:
    return tk.token_to_bytes(int(tok)).decode("utf-8", errors="replace")


def map_error(exc: BaseException) -> APIError:
    from edgellm.errors import (ContextFullError, EdgeLLMError, InvalidArgumentError, KVCacheFullError, TemplateError,
                                TokenizerError)

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (ContextFullError, KVCacheFullError)):  # a prompt longer than a sequence may hold
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    if isinstance(exc, (InvalidArgumentError, TemplateError, TokenizerError)):
        return APIError(400, str(exc), code="invalid_value")
    if isinstance(exc, EdgeLLMError):
        return APIError(500, str(exc))
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


class ModelHost:
    """Loads the model on a thread; admits requests up to n_seq running + `queue` waiting."""

    def __init__(self, load, *, queue: int = 64):
        self._load = load  # () -> Model
        self.max_waiting = queue
        self.model = None
        self.slots = 0  # sequences the engine runs at once (read once, after loading)
        self.load_error: BaseException | None = None
        self.ready = threading.Event()
        self.in_flight = 0  # requests admitted and not finished (touched on the event loop only)
        self.streams: set[Stream] = set()  # their Streams
        self.closing = False  # shutting down: no new requests
        # renders, tokenizes and submits requests (short work; the engine's thread does the steps)
        self._submitter = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="edgellm-submit")

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._load_thread, name="edgellm-load", daemon=True)
        t.start()
        return t

    def _load_thread(self) -> None:
        """Load the model, then run every engine step in this thread (the scheduler's Engine.run_forever): the
        kernels ran first from here (the load's warm-up) and are fastest from here."""
        try:
            model = self._load()
            self.slots = int(model.engine_stats()["n_seq"])
            self.model = model
        except BaseException as exc:  # noqa: BLE001 - reported by the server
            self.load_error = exc
            self.ready.set()
            return
        self.ready.set()
        model.engine.run_forever()

    @property
    def loaded(self) -> bool:
        return self.ready.is_set() and self.model is not None

    @property
    def n_seq(self) -> int:
        return self.slots if self.loaded else 0

    @property
    def admitted(self) -> int:
        """Requests that count against the queue: in flight and not cancelled. A request whose client
        left holds its slot only until the engine's next step, so a client that gives up and asks
        again at once is not refused for its own abandoned request."""
        return sum(1 for s in tuple(self.streams) if not s.cancelled.is_set())  # (a copy: tests read it too)

    def require(self) -> None:
        if self.load_error is not None:
            raise APIError(503, f"the model failed to load: {self.load_error}", code="model_load_failed")
        if not self.loaded:
            raise APIError(503, "the model is still loading; retry in a few seconds", code="model_loading")

    async def open(self, start, kwargs: dict) -> Stream:
        """Admit a request and submit it (`start(model, kwargs)` returns the Request, run on the
        submit pool); raises APIError 503 when the queue is full, or what submit raised, mapped."""
        self.require()
        if self.closing:
            raise APIError(503, "the server is shutting down", code="server_shutting_down")
        if self.admitted >= self.n_seq + self.max_waiting:
            raise APIError(503, f"the server is busy ({self.admitted} requests running or waiting); "
                                "retry later", code="queue_full")
        stream = Stream(self, asyncio.get_running_loop(), want_logprobs=kwargs.get("logprobs") is not None)
        self.in_flight += 1
        self.streams.add(stream)
        submitted = self._submitter.submit(start, self.model, kwargs)
        try:
            req = await asyncio.wrap_future(submitted)
        except asyncio.CancelledError:  # the client left while submit ran: cancel what it submits
            stream.cancelled.set()
            submitted.add_done_callback(lambda f: f.exception() is None and f.result().cancel())
            self._done(stream)
            raise
        except BaseException as exc:  # noqa: BLE001 - mapped for the client
            self._done(stream)
            raise map_error(exc) from None
        stream.attach(req)
        return stream

    def _done(self, stream: Stream) -> None:
        if stream in self.streams:
            self.in_flight -= 1
            self.streams.discard(stream)

    async def drain(self, grace: float, give_up=lambda: False) -> int:
        """Shutting down: refuse new requests, give the running ones up to `grace` seconds to
        finish, then end the rest (their clients are told the server stops). Returns how many were
        ended; waits (a few seconds at most) until the engine has let go of them."""
        self.closing = True
        loop = asyncio.get_running_loop()
        t_end = loop.time() + grace
        while self.streams and loop.time() < t_end and not give_up():
            await asyncio.sleep(0.05)
        left = list(self.streams)
        for stream in left:
            stream.abort()
        t_end = loop.time() + 5.0
        while self.streams and loop.time() < t_end:
            await asyncio.sleep(0.02)
        return len(left)
