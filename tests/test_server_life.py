"""`edgellm serve` over its life: 503 while loading and after a failed load, the command itself
(loading, /health, SIGINT and SIGTERM with a stream running: finished or ended cleanly, exit 0, no
traceback), and a small soak (many clients that cancel and disconnect at random, then nothing may be
left held: no slot, no KV block, no request in flight)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from served import KEY, Served, pools_whole, reference, start_uvicorn

HI = [{"role": "user", "content": "What is the capital of France?"}]


# --- loading ---------------------------------------------------------------------------------------
def test_503_while_loading_then_after_a_failed_load():
    from edgellm.errors import EdgeLLMError
    from edgellm.serve.app import Server, build_app
    from edgellm.serve.host import ModelHost

    gate = threading.Event()

    def load():
        gate.wait(30)
        raise EdgeLLMError("model.gguf: tensor 'output.weight' is truncated")

    engine = ModelHost(load)
    engine.start()
    uv, thread, url = start_uvicorn(build_app(Server(engine, model_path="model.gguf")))
    try:
        body = {"messages": HI, "max_tokens": 2}
        assert httpx.get(url + "/health").json() == {"status": "loading"}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "model_loading" and r.json()["error"]["type"] == "server_overloaded_error"
        assert httpx.post(url + "/tokenize", json={"content": "x"}).status_code == 503
        gate.set()
        engine.ready.wait(10)
        h = httpx.get(url + "/health")
        assert h.status_code == 500 and "truncated" in h.json()["message"]
        r = httpx.post(url + "/v1/chat/completions", json=body)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "model_load_failed" and "truncated" in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    finally:
        uv.should_exit = True
        thread.join(10)


# --- the command -----------------------------------------------------------------------------------
def _serve(path, *args) -> tuple[subprocess.Popen, str]:
    """`edgellm serve` on a free port, once its model is loaded: (process, URL)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", str(path), "--port", "0", "-t", "1",
                             "--alias", "smol", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        statuses = []
        for _ in range(1200):
            r = httpx.get(url + "/health")
            statuses.append(r.status_code)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}
        ready = proc.stdout.readline()
        while "ready" not in ready:
            ready = proc.stdout.readline()
        assert f"model 'smol' ready: {url}/v1" in ready
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, url


def _stopped(proc, t_signal: float, bound: float) -> str:
    """The server's stderr once it exited 0 within `bound` seconds of the signal, without a traceback."""
    try:
        rc = proc.wait(bound + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    elapsed = time.monotonic() - t_signal
    err = proc.stderr.read()
    assert rc == 0, err
    assert elapsed < bound, (elapsed, err)
    assert "Traceback" not in err and "ERROR" not in err and "Exception" not in err, err
    assert err.rstrip().endswith("edgellm serve: stopped")
    return err


def test_sigint_lets_a_running_stream_finish(smollm2_path):
    proc, url = _serve(smollm2_path, "-np", "1", "-c", "256", "--shutdown-timeout", "120")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="smol", messages=HI, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3
    stream = iter(client.chat.completions.create(model="smol", messages=HI, max_tokens=40, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True},
                                                 stream_options={"include_usage": True}))
    chunks = [next(stream), next(stream)]  # the role, the first token
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):  # no new connections while the stream finishes
        httpx.get(url + "/health", timeout=5)
    chunks += list(stream)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 40
    err = _stopped(proc, t0, 120)
    assert "1 running request(s) get up to 120 s" in err and "ended" not in err


def test_sigterm_ends_a_long_stream_and_exits_0(smollm2_path):
    proc, url = _serve(smollm2_path, "-np", "2", "-c", "2048", "--shutdown-timeout", "1")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stream = iter(client.chat.completions.create(model="smol", messages=HI, max_tokens=1800, stream=True,
                                                 extra_body={"ignore_eos": True}))
    got = [next(stream) for _ in range(4)]
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError) as e:  # told, not left with a silently cut answer
        got += list(stream)
    assert "shutting down" in e.value.message and e.value.body["code"] == "server_shutting_down"
    assert 4 <= len(got) < 1800
    err = _stopped(proc, t0, 1 + 10)
    assert "ended 1 request(s) still running" in err


# --- soak ------------------------------------------------------------------------------------------
SOAK_REQUESTS = 40
SOAK_CLIENTS = 8
# full: read to the end (streamed or not); drop: close the stream after 1-6 tokens; early: close it
# before the first token (the request may still wait for a slot); timeout: a non-streamed request
# whose client gives up mid-answer
KINDS = ("stream", "json", "drop", "early", "timeout")
TOPICS = ["a fruit", "the sea", "a city", "music", "rain", "a bridge", "the moon", "bread"]


@pytest.fixture(scope="module")
def soak_srv(smollm2_path):
    s = Served(smollm2_path, queue=SOAK_CLIENTS, n_ctx=512, n_seq=4, threads=1)
    yield s
    s.close()


async def _soak_request(client: httpx.AsyncClient, name: str, kind: str, i: int, rng: random.Random) -> str:
    """One request of the soak; its finish reason, or "gone" when the client left."""
    max_tokens = rng.randint(4, 40)
    body = {"model": name, "messages": [{"role": "user", "content": f"Say something about {rng.choice(TOPICS)}."}],
            "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "seed": i}
    if kind in ("drop", "early", "timeout"):  # long enough that it cannot end before the client leaves
        body.update(max_tokens=400, ignore_eos=True)
    if kind == "json":
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert 1 <= r.json()["usage"]["completion_tokens"] <= max_tokens
        return r.json()["choices"][0]["finish_reason"]
    if kind == "timeout":
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.05, 0.5))
        return "gone"
    body.update(stream=True, stream_options={"include_usage": True})
    drop_after = rng.randint(1, 6)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        if kind == "early":
            return "gone"
        n, finish, usage = 0, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            usage = obj.get("usage") or usage
            for ch in obj["choices"]:
                finish = ch["finish_reason"] or finish
                if ch["delta"].get("content"):
                    n += 1
                    if kind == "drop" and n >= drop_after:
                        return "gone"
        assert finish in ("stop", "length") and 1 <= usage["completion_tokens"] <= max_tokens
        return finish


async def _soak(url: str, name: str, kinds: list[str], rng: random.Random) -> list[str]:
    todo = list(enumerate(kinds))
    out = []

    async def client_loop(client):
        while todo:
            i, kind = todo.pop()
            out.append((kind, await _soak_request(client, name, kind, i, rng)))

    async with httpx.AsyncClient(base_url=url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(SOAK_CLIENTS)))
    return out


class _Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


def test_soak_leaves_nothing_held(soak_srv):
    srv = soak_srv
    want = reference(srv.model, HI, temperature=0, max_tokens=12)
    rng = random.Random(15)
    kinds = [KINDS[i % len(KINDS)] for i in range(SOAK_REQUESTS)]
    rng.shuffle(kinds)
    m0, e0 = srv.metrics(), srv.model.engine_stats()
    errors = _Errors()
    logging.getLogger("uvicorn.error").addHandler(errors)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        done = asyncio.run(_soak(srv.url, srv.name, kinds, rng))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        logging.getLogger("uvicorn.error").removeHandler(errors)
    assert len(done) == SOAK_REQUESTS and errors.records == []
    srv.idle(timeout=10)
    m1, e1 = srv.metrics(), srv.model.engine_stats()

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return m1.get(key, 0) - m0.get(key, 0)

    # every request counted once, by how it ended; no error of any status
    gone = sum(1 for _, how in done if how == "gone")
    assert gone == sum(1 for k in kinds if k in ("drop", "early", "timeout"))
    assert delta("edgellm_requests_finished_total", finish_reason="cancelled") == gone
    ended = {how: sum(1 for _, h in done if h == how) for how in ("stop", "length")}
    for reason, n in ended.items():
        assert delta("edgellm_requests_finished_total", finish_reason=reason) == n
    assert not [k for k in m1 if k[0] == "edgellm_request_errors_total" and m1[k] != m0.get(k, 0)]
    assert e1["requests_total"] - e0["requests_total"] == SOAK_REQUESTS
    assert (e1["requests_finished"] - e0["requests_finished"]) + (e1["requests_cancelled"] - e0["requests_cancelled"]) \
        == SOAK_REQUESTS
    # nothing held: no slot, no request, no KV block (only cached ones), every block accounted for
    for name in ("edgellm_requests_running", "edgellm_requests_waiting", "edgellm_http_requests_in_flight",
                 "edgellm_kv_blocks_used"):
        assert m1[(name, ())] == 0, name
    assert m1[("edgellm_kv_blocks_cached", ())] > 0
    assert m1[("edgellm_kv_blocks_cached", ())] + m1[("edgellm_kv_blocks_free", ())] == \
        m1[("edgellm_kv_blocks_total", ())]
    pools_whole(srv.model)
    assert srv.engine.streams == set()
    # and the engine still answers as before
    r = srv.client.chat.completions.create(model=srv.name, messages=HI, temperature=0, max_tokens=12)
    assert r.choices[0].message.content == want[0]
    print(f"soak: {SOAK_REQUESTS} requests, {SOAK_CLIENTS} clients, {gone} left early, {wall:.1f} s "
          f"({cpu:.1f} s CPU), {e1['gen_tokens_total'] - e0['gen_tokens_total']} tokens generated, "
          f"{e1['prompt_tokens_total'] - e0['prompt_tokens_total']} prompt tokens evaluated")
