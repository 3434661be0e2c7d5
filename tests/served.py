"""An `edgellm serve` app in this process for the server tests: the real model, uvicorn on a thread
listening on 127.0.0.1, the official `openai` client and raw httpx pointed at it."""
from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import uvicorn

KEY = "sk-edgellm-test"


def start_uvicorn(app):
    """(uvicorn.Server, its thread, URL) for `app` on a free port of 127.0.0.1, once it listens."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if uv.started:
            break
        time.sleep(0.05)
    assert uv.started
    return uv, thread, url


class Served:
    def __init__(self, path, *, queue: int = 8, ping_seconds: float = 0.5, **load):
        """Loads `path` with `load`'s arguments on the engine's thread, as `edgellm serve` does: that
        thread runs every step, and Numba's thread count (set at load) is per thread."""
        import edgellm
        from edgellm.serve.app import Server, build_app
        from edgellm.serve.host import ModelHost

        self.engine = ModelHost(lambda: edgellm.load(path, **load), queue=queue)
        self.engine.start()
        self.engine.ready.wait()
        if self.engine.load_error is not None:
            raise self.engine.load_error
        self.model = self.engine.model
        self.server = Server(self.engine, model_path=path, api_key=KEY, ping_seconds=ping_seconds)
        self.uv, self.thread, self.url = start_uvicorn(build_app(self.server))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600)
        self.name = self.server.name

    def close(self):
        self.uv.should_exit = True
        self.client.close()
        self.thread.join(10)
        self.http.close()
        self.model.close()  # ends the engine thread (Engine.run_forever)

    def idle(self, timeout: float = 5.0) -> dict:
        """engine_stats once no sequence runs (fails after `timeout` seconds)."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            s = self.model.engine_stats()
            if s["running"] == 0 and s["waiting"] == 0 and self.engine.in_flight == 0:
                return s
            time.sleep(0.02)
        raise AssertionError(f"still busy after {timeout} s: {self.model.engine_stats()}")

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        r = self.http.get("/metrics")
        assert r.status_code == 200
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def reference(model, prompt_or_messages, **kw) -> tuple[str, str, int]:
    """(text, finish_reason, tokens) of the same request through the Python API."""
    call = model.chat if isinstance(prompt_or_messages, list) else model.generate
    chunks = list(call(prompt_or_messages, **kw))
    return "".join(c.text for c in chunks), chunks[-1].finish_reason, len(chunks)


def sse_events(r) -> list:
    """The `data:` payloads of a raw SSE response; comment lines (pings) are dropped."""
    out = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            out.append(line[6:])
        else:
            assert line == "" or line.startswith(":"), line
    return out


def pools_whole(model) -> None:
    """Every KV block of every group is free or cached, each exactly once (none lost, none held)."""
    for g in model.runtime.cache.groups:
        pool = g.pool
        free, cached = list(pool.free), list(pool.lru)
        assert int((pool.ref != 0).sum()) == 0, "blocks still held"
        assert len(free) + len(cached) == pool.n_blocks, (len(free), len(cached), pool.n_blocks)
        assert set(free) | set(cached) == set(range(pool.n_blocks))
