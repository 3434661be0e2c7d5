"""The Starlette application: routes, authentication, JSON and server-sent-event answers.

Nothing here touches the model: requests go through `ModelHost.open` (submitted on a small pool,
their chunks pushed by the engine's thread), tokenize / detokenize through `asyncio.to_thread`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from edgellm.serve import protocol as P
from edgellm.serve.host import ModelHost, Stream
from edgellm.serve.metrics import Metrics

MAX_BODY_BYTES = 16 << 20
PING_SECONDS = 5.0  # an SSE comment line while no token comes (a long prompt, a full queue)


_SHUTDOWN = P.APIError(503, "the server is shutting down; the answer was cut short", code="server_shutting_down")


def _error(e: P.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")  # Python's json module would accept NaN and Infinity


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Events(StreamingResponse):
    """Server-sent events whose end always reaches the engine: however the response ends (the
    client left, the server stopped) the event generator is closed at once, not when the garbage
    collector finds it, and `on_end` runs (it cancels a sequence whose events never started)."""

    def __init__(self, events, on_end):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_end()


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The state behind the routes: the engine, the names the model answers to, metrics, the key."""

    def __init__(self, engine: ModelHost, *, model_path: str | Path | None = None, alias: str | None = None,
                 api_key: str | None = None, ping_seconds: float = PING_SECONDS):
        self.engine = engine
        self.name = alias or (Path(model_path).stem if model_path else "edgellm")
        self.names = {self.name} | ({Path(model_path).name, Path(model_path).stem, str(model_path)}
                                    if model_path else set())
        self.api_key = api_key
        self.ping_seconds = ping_seconds
        self.metrics = Metrics()
        self.created = int(time.time())

    # --- plumbing ---------------------------------------------------------------------------------
    def endpoint(self, handler, *, auth: bool = True):
        async def wrapped(request: Request) -> Response:
            try:
                if auth:
                    self._authorize(request)
                return await handler(request)
            except P.APIError as e:
                self.metrics.error(e.status)
                return _error(e)
        return wrapped

    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise P.APIError(401, "Incorrect API key provided; pass it as 'Authorization: Bearer KEY'",
                             code="invalid_api_key")

    @staticmethod
    async def _json(request: Request):
        too_large = P.APIError(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise too_large
        parts, n = [], 0
        try:
            async for part in request.stream():  # read up to the limit only (a chunked body has no length)
                n += len(part)
                if n > MAX_BODY_BYTES:
                    raise too_large
                parts.append(part)
        except ClientDisconnect:  # nobody reads the answer: one access-log line, no traceback
            raise P.APIError(400, "the client closed the connection before the whole request body came") from None
        raw = b"".join(parts)
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except ValueError as exc:
            raise P.APIError(400, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise P.APIError(400, "the request body is nested too deeply") from None

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names:
            raise P.APIError(404, f"The model '{name}' does not exist; this server serves '{self.name}'",
                             param="model", code="model_not_found")

    # --- routes -----------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        eng = self.engine
        if eng.load_error is not None:
            return JSONResponse({"status": "error", "message": str(eng.load_error)}, status_code=500)
        if not eng.loaded:
            return JSONResponse({"status": "loading"}, status_code=503)
        s = await asyncio.to_thread(eng.model.engine_stats)
        return JSONResponse({"status": "ok", "slots_idle": s["n_seq"] - s["running"],
                             "slots_processing": s["running"], "requests_waiting": s["waiting"]})

    async def metrics_text(self, request: Request) -> Response:
        stats = await asyncio.to_thread(self.engine.model.engine_stats) if self.engine.loaded else None
        return PlainTextResponse(self.metrics.render(stats, self.engine.in_flight),
                                 media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        meta = {}
        if self.engine.loaded:
            m = self.engine.model
            meta = {"n_ctx": m.n_ctx, "n_vocab": m.n_vocab, "n_seq": self.engine.n_seq}
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                                         "owned_by": "edgellm", "meta": meta}]})

    async def tokenize(self, request: Request) -> Response:
        body = await self._json(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise P.APIError(400, "'content' must be a string", param="content")
        flags = {k: body.get(k, d) for k, d in (("add_special", False), ("parse_special", True))}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise P.APIError(400, f"'{k}' must be true or false", param=k)
        self.engine.require()
        ids = await asyncio.to_thread(self.engine.model.tokenize, body["content"], **flags)
        return JSONResponse({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self._json(request)
        ids = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise P.APIError(400, "'tokens' must be a list of token ids", param="tokens")
        self.engine.require()
        m = self.engine.model
        bad = [t for t in ids if not 0 <= t < m.n_vocab]
        if bad:
            raise P.APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{m.n_vocab - 1})", param="tokens")
        return JSONResponse({"content": await asyncio.to_thread(m.detokenize, ids)})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, P.parse_chat(await self._json(request)))

    async def completion(self, request: Request) -> Response:
        return await self._complete(request, P.parse_completion(await self._json(request)))

    # --- generation -------------------------------------------------------------------------------
    async def _complete(self, request: Request, p: P.Parsed) -> Response:
        self._check_model(p.model)
        self.engine.require()
        extra = p.extra
        if p.kind == "chat":
            messages = p.prompt

            def start(model, kwargs):
                return model.submit_chat(messages, **kwargs, **extra)
        else:
            prompt = p.prompt

            def start(model, kwargs):
                return model.submit(prompt, **kwargs, **extra)
        stream = await self.engine.open(start, p.sampling.submit_kwargs(self.engine.model.n_ctx))
        rid = ("chatcmpl-" if p.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        if p.stream:
            return _Events(self._sse(p, stream, rid), lambda: self._abandon(stream))
        collect = asyncio.ensure_future(self._collect(stream))
        gone = asyncio.ensure_future(_disconnected(request))
        finished = False
        try:
            done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            finished = collect in done
        finally:
            gone.cancel()
            if not finished:  # the client left (or this task was cancelled): free the slot now
                collect.cancel()
                stream.cancel()
                self._finish(stream, "cancelled", 0, None, None)
        if not finished:
            return Response(status_code=499)  # nobody reads it
        text, pieces, finish, calls = collect.result()
        created = int(time.time())
        if p.kind == "chat":
            body = P.chat_message(rid, created, self.name, text, finish, pieces, p.sampling.logprobs is not None,
                                  calls)
        else:
            lp = P.completion_logprobs(pieces) if p.sampling.logprobs is not None else None
            body = P.completion_body(rid, created, self.name, text, finish, lp)
        body["usage"] = P.usage(stream.stats)
        body["timings"] = P.timings(stream.stats)
        return JSONResponse(body)

    async def _collect(self, stream: Stream):
        """(text, logprob entries (Stream.logprob_entry), finish_reason, tool calls) once the request ends."""
        parts, pieces, finish, n, first, last, calls = [], [], None, 0, None, None, ()
        try:
            while (c := await stream.next()) is not None:
                n += 1
                first = first or stream.t_last
                last = stream.t_last
                parts.append(c.text)
                if c.logprob is not None and (entry := stream.logprob_entry(c)) is not None:
                    pieces.append(entry)
                finish = c.finish_reason or finish
                calls = c.tool_calls or calls
        except P.APIError:
            self._finish(stream, "error", n, first, last)
            raise
        if stream.aborted and finish is None:
            self._finish(stream, "shutdown", n, first, last)
            raise _SHUTDOWN
        self._finish(stream, finish or "stop", n, first, last)
        return "".join(parts), pieces, finish or "stop", calls

    def _finish(self, stream: Stream, reason: str, n: int, first, last) -> None:
        if not stream.reported:  # once per request, however it ended
            stream.reported = True
            self.metrics.request_done(reason, stream.t_start, first, last, n)

    def _abandon(self, stream: Stream) -> None:
        """A streamed response ended: if its events never ran to an end (the client left before
        the first one was sent), cancel the sequence now."""
        if not stream.reported:
            stream.cancel()
            self._finish(stream, "cancelled", 0, None, None)

    async def _sse(self, p: P.Parsed, stream: Stream, rid: str):
        created = int(time.time())
        chat = p.kind == "chat"
        want_lp = p.sampling.logprobs is not None
        reason, n, first, last, held = "cancelled", 0, None, None, None
        offset = 0  # completion logprobs: characters streamed so far

        def chunk(text: str, finish, pieces) -> dict:
            nonlocal offset
            if chat:
                return P.chat_chunk(rid, created, self.name, {"content": text} if text else {}, finish, pieces,
                                    want_lp)
            lp = P.completion_logprobs(pieces, offset) if want_lp and pieces else None
            offset += len(text)
            return P.completion_body(rid, created, self.name, text, finish, lp)

        try:
            if chat:
                yield _event(P.chat_chunk(rid, created, self.name, {"role": "assistant", "content": ""}, None))
            while True:
                try:
                    c = await stream.next(self.ping_seconds)
                except (asyncio.TimeoutError, TimeoutError):
                    yield b": ping\n\n"
                    continue
                if c is None:
                    break
                n += 1
                first = first or stream.t_last
                last = stream.t_last
                entry = stream.logprob_entry(c) if want_lp else None
                pieces = [entry] if entry is not None else []
                if c.finish_reason is not None:
                    if c.tool_calls:  # content first, then each call: its id and name, its arguments
                        if c.text:
                            yield _event(chunk(c.text, None, pieces))
                        for delta in P.tool_call_deltas(c.tool_calls):
                            yield _event(P.chat_chunk(rid, created, self.name, delta, None))
                        held = chunk("", c.finish_reason, [])
                    else:
                        held = chunk(c.text, c.finish_reason, pieces)  # sent with the timings at the end
                    reason = c.finish_reason
                elif c.text or pieces:
                    yield _event(chunk(c.text, None, pieces))
            if stream.aborted and held is None:  # the server stops: say so, not finish an answer cut short
                reason = "shutdown"
                yield _event(_SHUTDOWN.body())
                return
            if held is None:  # ended without a finish reason (cannot happen with a conforming engine)
                held, reason = chunk("", "stop", []), "stop"
            held["timings"] = P.timings(stream.stats)
            yield _event(held)
            if p.include_usage:
                yield _event(P.usage_chunk(p.kind, rid, created, self.name, stream.stats))
            yield b"data: [DONE]\n\n"
        except P.APIError as e:  # the engine failed mid-stream: the status line is gone, say it in the stream
            reason = "error"
            self.metrics.error(e.status)
            yield _event(e.body())
        finally:
            if reason == "cancelled":  # the client went away (this generator was cancelled or closed)
                stream.cancel()
            self._finish(stream, reason, n, first, last)


def build_app(server: Server) -> Starlette:
    s = server
    routes = [
        Route("/health", s.endpoint(s.health, auth=False), methods=["GET"]),
        Route("/metrics", s.endpoint(s.metrics_text), methods=["GET"]),
        Route("/v1/models", s.endpoint(s.models), methods=["GET"]),
        Route("/v1/chat/completions", s.endpoint(s.chat), methods=["POST"]),
        Route("/v1/completions", s.endpoint(s.completion), methods=["POST"]),
        Route("/tokenize", s.endpoint(s.tokenize), methods=["POST"]),
        Route("/detokenize", s.endpoint(s.detokenize), methods=["POST"]),
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        what = "route" if exc.status_code == 404 else "method"
        e = P.APIError(exc.status_code, f"no {what} {request.method} {request.url.path} on this server",
                       code="not_found" if exc.status_code == 404 else "method_not_allowed")
        s.metrics.error(e.status)
        return _error(e)

    async def server_error(request: Request, exc: Exception) -> Response:
        s.metrics.error(500)
        return _error(P.APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.server = server
    return app
