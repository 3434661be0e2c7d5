"""`edgellm serve` over a real socket: the official `openai` client and raw httpx against a server on
127.0.0.1 serving the real SmolLM2 file, checked against `Model.chat` / `Model.generate` on the same
model object. One server (a uvicorn thread in this process) for the module; the `edgellm serve`
command, shutdown and the soak are in test_server_life.py."""
from __future__ import annotations

import json
import math
import re
import threading
import time

import httpx  # the 'test' extra has the server's dependencies and the clients
import openai
import pytest
from served import KEY, Served, reference, sse_events

pytestmark = [pytest.mark.real, pytest.mark.slow]

N_SEQ = 2
N_CTX = 1024
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv(smollm2_path):
    s = Served(smollm2_path, n_ctx=N_CTX, n_seq=N_SEQ, threads=1)
    yield s
    s.close()


# --- generation ----------------------------------------------------------------------------------
def test_chat_equals_model_chat(srv):
    text, finish, n = reference(srv.model, HI, temperature=0, max_tokens=24)
    r = srv.client.chat.completions.create(model=srv.name, messages=HI, temperature=0, max_tokens=24)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == finish
    assert r.usage.completion_tokens == n
    prompt_ids = srv.model.tokenize(srv.model.render_chat(HI), add_special=True, parse_special=True)
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.total_tokens == len(prompt_ids) + n
    # the same prompt just ran through model.chat: its full blocks come from the prefix cache
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < len(prompt_ids)
    t = r.model_extra["timings"]
    assert t["predicted_n"] == n and t["prompt_n"] + t["cache_n"] == len(prompt_ids) and t["ttft_ms"] > 0


def test_chat_stream_with_usage(srv):
    text, finish, n = reference(srv.model, HI, temperature=0, max_tokens=20)
    chunks = list(srv.client.chat.completions.create(model=srv.name, messages=HI, temperature=0, max_tokens=20,
                                                     stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert len({c.id for c in chunks}) == 1


def test_completion_equals_generate_and_raw_sse(srv):
    prompt = "The three primary colors are"
    text, finish, n = reference(srv.model, prompt, temperature=0, max_tokens=16)
    r = srv.client.completions.create(model=srv.name, prompt=prompt, temperature=0, max_tokens=16)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish == "length"
    assert r.usage.completion_tokens == n == 16
    # a prompt of token ids is the same request
    ids = srv.model.tokenize(prompt, add_special=True, parse_special=True)
    r2 = srv.client.completions.create(model=srv.name, prompt=ids, temperature=0, max_tokens=16)
    assert r2.choices[0].text == text and r2.usage.prompt_tokens == len(ids)
    # streamed, read as raw server-sent events
    body = {"model": srv.name, "prompt": prompt, "temperature": 0, "max_tokens": 16, "stream": True}
    with srv.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert "".join(o["choices"][0]["text"] for o in objs) == text
    assert objs[-1]["choices"][0]["finish_reason"] == "length" and objs[-1]["timings"]["predicted_n"] == 16
    assert all(o["object"] == "text_completion" for o in objs)


def test_stop_string(srv):
    text, _, _ = reference(srv.model, HI, temperature=0, max_tokens=24)
    words = re.findall(r"[A-Za-z]{4,}", text)
    stop = words[1]  # a word from inside the greedy answer
    r = srv.client.chat.completions.create(model=srv.name, messages=HI, temperature=0, max_tokens=24, stop=[stop, "@@@"])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs(srv):
    r = srv.client.chat.completions.create(model=srv.name, messages=HI, temperature=0, max_tokens=8, logprobs=True,
                                           top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= 8
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        tops = [t.logprob for t in c.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert c.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy: the sampled token is the top one
        assert c.token == c.top_logprobs[0].token
        assert all(lp <= 0 for lp in tops) and sum(math.exp(lp) for lp in tops) <= 1 + 1e-4
    r = srv.client.completions.create(model=srv.name, prompt="1, 2, 3, 4,", temperature=0, max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) == 2 and max(t.values()) == pytest.approx(v, abs=1e-5) for t, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_concurrent_requests(srv):
    prompts = ["Name a fruit.", "Count to five.", "Say hello.", "What is 2+2?"]  # 4 requests on 2 slots
    want = {p: reference(srv.model, [{"role": "user", "content": p}], temperature=0, max_tokens=8) for p in prompts}
    m0 = srv.metrics()
    got, errors = {}, []

    def ask(p):
        try:
            r = srv.client.chat.completions.create(model=srv.name, messages=[{"role": "user", "content": p}],
                                                   temperature=0, max_tokens=8)
            got[p] = (r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert got == want
    m1 = srv.metrics()
    ttft = ("edgellm_time_to_first_token_seconds_count", ())
    assert m1[ttft] - m0[ttft] == len(prompts)
    gen = ("edgellm_generation_tokens_total", ())
    assert m1[gen] - m0[gen] == sum(n for _, _, n in want.values())
    srv.idle()


# --- the connection ------------------------------------------------------------------------------
def test_disconnect_frees_the_slot(srv):
    srv.idle()
    m0 = srv.metrics()
    body = {"model": srv.name, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with srv.http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        got = []
        for line in resp.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 3:
                break
        assert srv.model.engine_stats()["running"] == 1
    t0 = time.perf_counter()
    stats = srv.idle(timeout=3)
    assert time.perf_counter() - t0 < 3
    assert stats["running"] == 0
    m1 = srv.metrics()
    key = ("edgellm_requests_finished_total", (("finish_reason", "cancelled"),))
    assert m1[key] - m0.get(key, 0) == 1
    assert m1[("edgellm_generation_tokens_total", ())] - m0[("edgellm_generation_tokens_total", ())] < 400
    r = srv.client.completions.create(model=srv.name, prompt="Hi", max_tokens=2)  # the slot serves again
    assert r.usage.completion_tokens <= 2


class _Tap(httpx.BaseTransport):
    """An httpx transport that keeps a copy of every response body's bytes as they arrive."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request):
        resp = self.inner.handle_request(request)
        return httpx.Response(resp.status_code, headers=resp.headers, stream=_Copy(resp.stream, self.raw),
                              extensions=resp.extensions)

    def close(self):
        self.inner.close()


class _Copy(httpx.SyncByteStream):
    def __init__(self, inner, sink: bytearray):
        self.inner, self.sink = inner, sink

    def __iter__(self):
        for part in self.inner:
            self.sink += part
            yield part

    def close(self):
        self.inner.close()


def test_pings_while_a_long_prompt_is_evaluated(srv):
    srv.idle()
    # ~850 tokens no other test sends (nothing cached): the first token waits for their evaluation
    ids = srv.model.tokenize(" ".join(f"parcel{i}" for i in range(400)), add_special=False)
    messages = [{"role": "user", "content": "Which parcel is last? " + srv.model.detokenize(ids[:850])}]
    tap = _Tap()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0,
                           http_client=httpx.Client(transport=tap, timeout=600))
    srv.server.ping_seconds = 0.25
    try:
        chunks = list(client.chat.completions.create(model=srv.name, messages=messages, temperature=0, max_tokens=6,
                                                     stream=True))
    finally:
        srv.server.ping_seconds = 0.5
    # raw: comment lines before the first token, every other event a data line, [DONE] last
    events = [e for e in bytes(tap.raw).decode().split("\n\n") if e]
    first = next(i for i, e in enumerate(events) if e.startswith("data: {") and
                 json.loads(e[6:])["choices"][0]["delta"].get("content"))
    pings = [e for e in events[:first] if e.startswith(":")]
    assert len(pings) >= 1 and all(e == ": ping" for e in pings)
    assert all(e.startswith("data: ") or e == ": ping" for e in events) and events[-1] == "data: [DONE]"
    # the openai client skipped the pings: the same answer as the Python API
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finish.model_extra["timings"]["prompt_n"] >= 800  # evaluated here, not taken from the cache
    text, _, _ = reference(srv.model, messages, temperature=0, max_tokens=6)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_queue_full_is_503(srv):
    srv.idle()
    srv.engine.max_waiting = 0
    # ~1000 tokens each: on a fast machine 300 tokens once ran out (~2 s) while a busy host was
    # between the first 200 and taking the step lock
    body = {"model": srv.name, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    try:
        with srv.http.stream("POST", "/v1/completions", json=body) as a, \
                srv.http.stream("POST", "/v1/completions", json=body) as b:
            assert a.status_code == b.status_code == 200
            # no step runs while the test holds the engine's step lock: neither stream can finish (a
            # slow moment between the two 200s and the third request once let one finish first)
            with srv.model.engine.held(), pytest.raises(openai.InternalServerError) as e:
                assert srv.engine.in_flight == 2
                srv.client.chat.completions.create(model=srv.name, messages=HI, max_tokens=2)
            assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    finally:
        srv.engine.max_waiting = 8
    srv.idle()


def test_a_client_that_left_does_not_hold_a_queue_place(srv):
    """A client that drops its stream and asks again at once is admitted, though its abandoned
    request stays in flight until the engine's next step (held off here by the step lock)."""
    srv.idle()
    srv.engine.max_waiting = 0
    # ~1000 tokens: a must still run when the third request comes (300 once ran out first on a
    # fast host); the third is seen by its own Stream, not by a count a's end would change
    body = {"model": srv.name, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    status = []

    def ask_again():
        with srv.http.stream("POST", "/v1/completions", json=body) as c:
            status.append(c.status_code)

    try:
        with srv.http.stream("POST", "/v1/completions", json=body) as a:
            b = srv.http.stream("POST", "/v1/completions", json=body)
            assert a.status_code == b.__enter__().status_code == 200
            with srv.model.engine.held():  # no step: b's request cannot end
                # once b's request is attached, its end comes only from the engine's next step (a
                # cancel marks it; the step drops it), so b's request stays in flight
                sb = max(srv.engine.streams, key=lambda x: x.t_start)
                t0 = time.monotonic()
                def attached():
                    return sb.request is not None and sb.request.attached

                while not attached() and time.monotonic() - t0 < 10:
                    time.sleep(0.01)
                assert attached()
                b.__exit__(None, None, None)  # b's client leaves
                t0 = time.monotonic()
                while srv.engine.admitted != 1 and time.monotonic() - t0 < 10:
                    time.sleep(0.01)
                assert srv.engine.in_flight == 2 and srv.engine.admitted == 1
                before = set(srv.engine.streams)
                again = threading.Thread(target=ask_again)
                again.start()
                t1 = time.monotonic()
                while not set(srv.engine.streams) - before and not status and time.monotonic() - t1 < 20:
                    time.sleep(0.01)
                new = set(srv.engine.streams) - before
                # admitted while b's request is still in flight
                assert len(new) == 1 and any(s.cancelled.is_set() for s in srv.engine.streams)
            again.join(60)
            assert status == [200]
    finally:
        srv.engine.max_waiting = 8
    srv.idle()


def test_a_client_that_sends_half_a_body_and_leaves_costs_no_traceback(srv, caplog):
    """20 clients each announce a body, send part of it and close: the server logs no traceback and
    answers the next request."""
    import logging
    import socket
    from urllib.parse import urlparse

    url = urlparse(srv.url)
    caplog.set_level(logging.INFO)
    for _ in range(20):
        with socket.create_connection((url.hostname, url.port)) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                      + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"Hi")
            time.sleep(0.02)
    time.sleep(0.5)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, errors[0].getMessage()
    r = srv.client.completions.create(model=srv.name, prompt="Hi", max_tokens=2)
    assert r.choices[0].finish_reason == "length"


# --- errors --------------------------------------------------------------------------------------
def _shape(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("extra, param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"grammar": "root ::= \"a\""}}, "response_format"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"stop": [1, 2]}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"cache_prompt": True}}, "cache_prompt"),
])
def test_bad_fields_are_400_naming_them(srv, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=srv.name, messages=HI, **{"max_tokens": 4, **extra})
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


def test_error_statuses_and_shape(srv):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    _shape(httpx.post(srv.url + "/v1/completions", json={"prompt": "x"}), 401)
    with pytest.raises(openai.NotFoundError) as e:
        srv.client.chat.completions.create(model="no-such-model", messages=HI)
    assert e.value.body["code"] == "model_not_found"
    _shape(srv.http.get("/v1/nothing"), 404)
    _shape(srv.http.post("/v1/chat/completions", content=b"{not json"), 400)
    _shape(srv.http.post("/v1/chat/completions", json={"messages": []}), 400)
    _shape(srv.http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400)
    _shape(srv.http.post("/v1/completions", json={"prompt": ["a", "b"]}), 400)
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.completions.create(model=srv.name, prompt="word " * (N_CTX + 10), max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    # a context-full prompt is refused before any stream starts
    r = srv.http.post("/v1/completions", json={"prompt": "word " * (N_CTX + 10), "stream": True})
    assert _shape(r, 400)["code"] == "context_length_exceeded"
    srv.idle()


def test_metrics_need_the_key(srv):
    # as llama-server: with an API key only /health is open (/metrics shows traffic and load)
    err = _shape(httpx.get(srv.url + "/metrics"), 401)
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    _shape(httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer wrong"}), 401)
    assert srv.http.get("/metrics").status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200


def test_body_too_large_and_wrong_method(srv):
    # sent chunked (no Content-Length): the server reads up to 16 MiB, not the whole body
    def body():
        yield b'{"prompt": "'
        for _ in range(16):
            yield b"x" * (1 << 20)
        yield b'"}'
    r = srv.http.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert "16 MiB" in _shape(r, 413)["message"]
    assert _shape(srv.http.get("/v1/chat/completions"), 405)["code"] == "method_not_allowed"


NEST = 100_000
A_USER = {"role": "user", "content": "x"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": -Infinity}', None),
    ("/v1/completions", b"[" * NEST + b"]" * NEST, None),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
    ("/v1/completions", b"\xff\xfe", None),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, None),
    ("/v1/completions", {"prompt": [-1]}, None),
    ("/v1/completions", {"prompt": [[1, 2], [3]]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 17}, "stop"),
    ("/v1/chat/completions", {"messages": [A_USER], "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{**A_USER, "tool_calls": []}]}, "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [A_USER], "model": 7}, "model"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_user_mistakes_are_400_never_500(srv, path, body, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    err = _shape(srv.http.post(path, **kw), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param


def test_seed_minus_one_is_random_as_in_llama_server(srv):
    r = srv.client.completions.create(model=srv.name, prompt="Hi", max_tokens=2, seed=-1)
    assert 1 <= r.usage.completion_tokens <= 2
    srv.idle()


def test_a_15_mb_prompt_is_refused_without_tokenizing_it(srv):
    """A prompt just under the body limit is refused at once, as the API refuses it (the tokenizer
    stops as soon as it cannot fit), for a completion and a chat."""
    text = "All work and no play makes Jack a dull boy. " * (15 * 2**20 // 44)
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        t0 = time.process_time()  # every thread of this process, the server's included
        r = srv.http.post(path, json={**body, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert time.process_time() - t0 < 5.0
    srv.idle()


# --- the other endpoints -------------------------------------------------------------------------
def test_models_health_tokenize(srv):
    assert [m.id for m in srv.client.models.list().data] == [srv.name]
    h = httpx.get(srv.url + "/health")  # no key needed
    assert h.status_code == 200
    assert h.json()["status"] == "ok" and h.json()["slots_idle"] + h.json()["slots_processing"] == N_SEQ
    text = "Hello, world! <|im_start|>"
    ids = srv.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == srv.model.tokenize(text, add_special=False, parse_special=True)
    assert srv.http.post("/detokenize", json={"tokens": ids[:4]}).json()["content"] == srv.model.detokenize(ids[:4])
    assert srv.http.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_parse(srv):
    srv.idle()
    m = srv.metrics()
    stats = srv.model.engine_stats()
    assert m[("edgellm_slots_total", ())] == N_SEQ
    assert m[("edgellm_requests_running", ())] == 0
    assert m[("edgellm_kv_blocks_total", ())] == stats["kv_blocks_total"]
    assert m[("edgellm_kv_blocks_used", ())] == stats["kv_blocks_used"] == 0  # idle: nothing held
    assert m[("edgellm_kv_blocks_cached", ())] == stats["kv_blocks_cached"] > 0  # earlier prompts kept
    assert m[("edgellm_kv_blocks_free", ())] + m[("edgellm_kv_blocks_cached", ())] == stats["kv_blocks_total"]
    assert m[("edgellm_http_requests_in_flight", ())] == 0
    inf = m[("edgellm_e2e_request_latency_seconds_bucket", (("le", "+Inf"),))]
    assert inf == m[("edgellm_e2e_request_latency_seconds_count", ())] >= 1
    assert m[("edgellm_request_errors_total", (("status", "400"),))] >= 1
