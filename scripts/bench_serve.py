"""Load benchmark of an OpenAI-compatible server: N concurrent streaming chat clients run a fixed list
of requests (mixed prompt and answer lengths, temperature 0) and report aggregate generated tokens/s,
TTFT p50/p99, time per output token p50/p99 and errors.

Runs against `edgellm serve` (started here with -np = clients) and, given its path, llama.cpp's
llama-server on the same file (started with -np = clients); or against a server already running
(--url). Dev tool, never imported by the package.

    python scripts/bench_serve.py MODEL.gguf --clients 1,4,8 --requests 32 \
        --llama-server path/to/llama-server -t 2 -c 8192
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

TOPICS = ["the history of the bicycle", "how a refrigerator works", "why the sky is blue", "the rules of chess",
          "how to bake bread", "the life cycle of a star", "what a compiler does", "how bees make honey"]
FILLER = ("Here is some background you may use. Memory is the scarcest resource on a small machine, and every "
          "byte of the key-value cache is a byte the weights cannot use. ")


def make_requests(n: int, seed: int, min_tokens: int, max_tokens: int) -> list[dict]:
    """n chat requests: prompts of 1-12 filler sentences, answers log-uniform in [min, max] tokens."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        context = FILLER * rng.choice([0, 1, 2, 4, 8, 12])
        question = f"{context}Explain {rng.choice(TOPICS)} in detail."
        answer = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        out.append({"messages": [{"role": "user", "content": question}], "max_tokens": answer})
    return out


async def one(client: httpx.AsyncClient, model: str, req: dict, ignore_eos: bool, drop_after: int | None = None) -> dict:
    """One streaming request; with drop_after=k the connection is closed after k content chunks."""
    body = {"model": model, "stream": True, "temperature": 0, "stream_options": {"include_usage": True},
            **req}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first = last = None
    n_chunks = 0
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"{r.status_code} {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    n_chunks += 1
                    if drop_after is not None and n_chunks >= drop_after:
                        return {"dropped": True}
    n = usage["completion_tokens"] if usage else n_chunks
    if first is None:
        return {"error": "no content"}
    return {"ttft": first - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
            "e2e": last - t0}


async def run_load(url: str, model: str, requests: list[dict], clients: int, ignore_eos: bool,
                   drop_rate: float = 0.0, seed: int = 0) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results = []
    rng = random.Random(seed)

    async def worker(client):
        while not queue.empty():
            req = queue.get_nowait()
            drop = rng.randint(1, 8) if rng.random() < drop_rate else None
            try:
                results.append(await one(client, model, req, ignore_eos, drop))
            except httpx.HTTPError as exc:
                results.append({"error": repr(exc)})

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    dropped = sum(1 for r in results if "dropped" in r)
    results = [r for r in results if "dropped" not in r]
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in ok)
    tpot = sorted(r["tpot"] for r in ok if r["tpot"] is not None)
    return {"clients": clients, "requests": len(results), "dropped": dropped, "errors": len(results) - len(ok),
            "error_examples": [r["error"] for r in results if "error" in r][:3],
            "tokens": sum(r["tokens"] for r in ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50_ms": 1000 * pct(tpot, 50),
            "tpot_p99_ms": 1000 * pct(tpot, 99)}


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(kind: str, args, clients: int) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    if kind == "edgellm":
        cmd = [sys.executable, "-m", "edgellm.cli", "serve", args.model, "--port", str(port), "-np", str(clients),
               "-c", str(args.ctx), "--kv-size", str(args.ctx), "-t", str(args.threads), "--alias", "bench"]
        env = os.environ
    else:
        binary = Path(args.llama_server)
        cmd = [str(binary), "-m", args.model, "--port", str(port), "-np", str(clients), "-c", str(args.ctx),
               "-t", str(args.threads), "-a", "bench", "--log-disable"]
        env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < args.start_timeout:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, "bench"
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"{kind} did not become healthy in {args.start_timeout} s")


def engine_gauges(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def soak(args) -> int:
    import psutil

    clients = max(int(c) for c in args.clients.split(","))
    proc, url, model = start("edgellm", args, clients)
    try:
        rss = psutil.Process(proc.pid).memory_info
        warm = make_requests(2 * clients, args.seed + 1, args.min_tokens, args.max_tokens)
        asyncio.run(run_load(url, model, warm, clients, args.ignore_eos, drop_rate=0.33, seed=args.seed))
        time.sleep(1)
        rss0 = rss().rss
        requests = make_requests(args.soak, args.seed, args.min_tokens, args.max_tokens)
        row = asyncio.run(run_load(url, model, requests, clients, args.ignore_eos, drop_rate=0.33, seed=args.seed))
        time.sleep(1)
        rss1 = rss().rss
        g = engine_gauges(url)
    finally:
        proc.terminate()
        proc.wait(30)
    leaks = {k: g.get(k) for k in ("edgellm_requests_running", "edgellm_requests_waiting")}
    used, cached = g.get("edgellm_kv_blocks_used"), g.get("edgellm_kv_blocks_cached")  # used: held by a sequence
    ok = not any(leaks.values()) and used == 0 and row["errors"] == 0 and abs(rss1 / rss0 - 1) <= 0.05
    print(f"soak: {row['requests'] + row['dropped']} requests ({row['dropped']} dropped), {row['errors']} errors, "
          f"{clients} clients; after: running {leaks['edgellm_requests_running']}, waiting "
          f"{leaks['edgellm_requests_waiting']}, KV blocks used {used} / cached {cached}; RSS "
          f"{rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB ({100 * (rss1 / rss0 - 1):+.1f}%): {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="GGUF file (both servers load it)")
    ap.add_argument("--clients", default="1,4,8,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=32, help="requests per client count")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens per request")
    ap.add_argument("-c", "--ctx", type=int, default=8192,
                    help="KV cache tokens: llama-server -c (split among its slots); edgellm --kv-size (a shared "
                         "pool; each sequence may use up to all of it)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also run llama-server from PATH")
    ap.add_argument("--no-edgellm", action="store_true", help="only llama-server")
    ap.add_argument("--url", default=None, help="a server already running (skips starting any)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="instead: N requests from the largest client count against edgellm serve, a third of "
                         "them dropped after 1-8 tokens; checks no slot or KV block leaks and RSS stays flat")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    if args.soak:
        return soak(args)
    requests = make_requests(args.requests, args.seed, args.min_tokens, args.max_tokens)
    kinds = [] if args.url else (["edgellm"] if not args.no_edgellm else []) + (
        ["llama-server"] if args.llama_server else [])
    rows = []
    for clients in [int(c) for c in args.clients.split(",")]:
        for kind in kinds or ["url"]:  # alternate servers at each client count
            proc = None
            if kind == "url":
                url = args.url
                model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            else:
                proc, url, model = start(kind, args, clients)
            try:
                asyncio.run(run_load(url, model, requests[:1], 1, args.ignore_eos))  # warm-up
                row = {"server": kind, **asyncio.run(run_load(url, model, requests, clients, args.ignore_eos))}
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
            rows.append(row)
            if not args.json:
                print(f"{row['server']:>12} clients {clients:>2}: {row['tokens_per_s']:6.1f} tok/s  "
                      f"TTFT p50 {row['ttft_p50']:.2f} s p99 {row['ttft_p99']:.2f} s  "
                      f"TPOT p50 {row['tpot_p50_ms']:.0f} ms p99 {row['tpot_p99_ms']:.0f} ms  "
                      f"errors {row['errors']} ({row['tokens']} tokens in {row['wall_s']:.1f} s)", flush=True)
                for e in row["error_examples"]:
                    print(f"             error: {e}", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
