"""Load benchmark of an OpenAI-compatible server: N concurrent streaming chat clients run a fixed list
of requests (mixed prompt and answer lengths, temperature 0) and report aggregate generated tokens/s,
TTFT p50/p99, time per output token p50/p99 and errors.

Runs against `edgellm serve` (started here with -np = clients) and, with --llama-server, llama.cpp's
llama-server on the same file (started with -np = clients; found in --llama-bin DIR, $LLAMA_BIN or
PATH: scripts/llamacpp.py), printing edgellm / llama-server ratios
per client count and a Markdown table; or against a server already running (--url). The issue's
sweep (1, 4, 8, 16 clients; 32 requests of 16-512 tokens; -t 2 -c 8192) is the default:

    python scripts/vs_llamacpp/bench_serve.py MODEL.gguf --llama-server [--llama-bin DIR]

`--first-run N` skips the warm-up request: the requests are a fresh server's first, followed by N
more on the same server (the warm figures to hold them against); the two series share no prompt
prefix (the same lengths, from the same seed), so both start from an empty prefix cache and only
the process's warmth differs.

`--soak N` instead runs N requests against `edgellm serve` with clients that leave early, and checks
that nothing leaks (see --help). Dev tool, never imported by the package.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-server)

TOPICS = ["the history of the bicycle", "how a refrigerator works", "why the sky is blue", "the rules of chess",
          "how to bake bread", "the life cycle of a star", "what a compiler does", "how bees make honey"]
FILLER = ("Here is some background you may use. Memory is the scarcest resource on a small machine, and every "
          "byte of the key-value cache is a byte the weights cannot use. ")


def make_requests(n: int, seed: int, min_tokens: int, max_tokens: int, series: str = "") -> list[dict]:
    """n chat requests: prompts of 1-12 filler sentences, answers log-uniform in [min, max] tokens.
    `series` starts every prompt (another series shares no cached prefix with this one)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        context = FILLER * rng.choice([0, 1, 2, 4, 8, 12])
        question = f"{series}{context}Explain {rng.choice(TOPICS)} in detail."
        answer = int(round(math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))))
        out.append({"messages": [{"role": "user", "content": question}], "max_tokens": answer})
    return out


async def one(client: httpx.AsyncClient, model: str, req: dict, ignore_eos: bool) -> dict:
    """One streaming request: its TTFT, time per output token, tokens and end-to-end time."""
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
    n = usage["completion_tokens"] if usage else n_chunks
    if first is None:
        return {"error": "no content"}
    return {"ttft": first - t0, "tpot": (last - first) / (n - 1) if n > 1 else None, "tokens": n,
            "e2e": last - t0}


async def run_load(url: str, model: str, requests: list[dict], clients: int, ignore_eos: bool) -> dict:
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results = []

    async def worker(client):
        while not queue.empty():
            req = queue.get_nowait()
            try:
                results.append(await one(client, model, req, ignore_eos))
            except httpx.HTTPError as exc:
                results.append({"error": repr(exc)})

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in ok)
    tpot = sorted(r["tpot"] for r in ok if r["tpot"] is not None)
    return {"clients": clients, "requests": len(results), "errors": len(results) - len(ok),
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


def start(kind: str, args, clients: int, stderr=subprocess.DEVNULL,
          llama_extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, str]:
    """(process, URL, model alias) of `kind` ("edgellm" or "llama-server") serving args.model once
    /health answers; llama-server also gets `llama_extra`'s flags."""
    port = free_port()
    if kind == "edgellm":
        cmd = [sys.executable, "-m", "edgellm.cli", "serve", args.model, "--port", str(port), "-np", str(clients),
               "-c", str(args.ctx), "--kv-size", str(args.ctx), "-t", str(args.threads), "--alias", "bench"]
        env = os.environ
    else:
        binary = llamacpp.tool("llama-server", args.llama_bin)
        cmd = [str(binary), "-m", args.model, "--port", str(port), "-np", str(clients), "-c", str(args.ctx),
               "-t", str(args.threads), "-a", "bench", "--log-disable", *llama_extra]
        env = llamacpp.env_for(binary)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < args.start_timeout:
            if proc.poll() is not None:
                raise SystemExit(f"{kind} exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return proc, url, "bench"
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise SystemExit(f"{kind} did not become healthy in {args.start_timeout} s")
    except BaseException:
        proc.kill()
        raise


def engine_gauges(url: str) -> dict:
    """/metrics as {name or name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# --- the soak ---------------------------------------------------------------------------------------
# how a soak request behaves: read to the end (streamed or not), or leave: close the stream after 1-8
# tokens ("drop"), before the first token ("early": it may still wait for a slot), or give up on a
# non-streamed answer after 0.1-2 s ("timeout"); the leaving ones ask for 512 tokens, ignoring EOS,
# so that they cannot end before their client leaves
SOAK_MIX = (("stream", 0.45), ("json", 0.15), ("drop", 0.2), ("early", 0.1), ("timeout", 0.1))
LEAVE = ("drop", "early", "timeout")


async def soak_one(client: httpx.AsyncClient, model: str, req: dict, kind: str, rng: random.Random) -> dict:
    """One soak request: {"how": finish reason | "gone"} or {"error": ...} for anything unexpected."""
    body = {"model": model, "temperature": 0, **req}
    if kind in LEAVE:
        body.update(max_tokens=512, ignore_eos=True)
    if kind == "json":
        r = await client.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.text[:200]}"}
        return {"how": r.json()["choices"][0]["finish_reason"]}
    if kind == "timeout":
        try:
            r = await client.post("/v1/chat/completions", json=body, timeout=rng.uniform(0.1, 2.0))
        except httpx.TimeoutException:
            return {"how": "gone"}
        return {"error": f"answered before the client gave up: {r.status_code}"}
    body.update(stream=True, stream_options={"include_usage": True})
    drop_after = rng.randint(1, 8)
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"{r.status_code} {r.text[:200]}"}
        if kind == "early":
            return {"how": "gone"}
        n, finish, done = 0, None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"error": f"in the stream: {obj['error']}"}
            for ch in obj.get("choices") or []:
                finish = ch.get("finish_reason") or finish
                if (ch.get("delta") or {}).get("content"):
                    n += 1
                    if kind == "drop" and n >= drop_after:
                        return {"how": "gone"}
        if finish is None or not done:
            return {"error": f"the stream ended without a finish reason or [DONE] after {n} tokens"}
        return {"how": finish}


async def soak_load(url: str, model: str, work: list, clients: int, pid: int, seed: int) -> tuple[list, list]:
    """Runs the soak's requests from `clients` clients while sampling the server's RSS every 0.25 s:
    (results, [(requests completed, RSS bytes)])."""
    import psutil

    proc = psutil.Process(pid)
    rng = random.Random(seed)
    todo = list(reversed(work))
    results, samples = [], []

    async def client_loop(client):
        while todo:
            req, kind = todo.pop()
            try:
                res = await soak_one(client, model, req, kind, rng)
            except httpx.HTTPError as exc:
                res = {"error": repr(exc)}
            results.append({"kind": kind, **res})

    async def sampler():
        while True:
            samples.append((len(results), proc.memory_info().rss))
            await asyncio.sleep(0.25)

    watch = asyncio.ensure_future(sampler())
    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    watch.cancel()
    samples.append((len(results), proc.memory_info().rss))
    return results, samples


def soak(args) -> int:
    import tempfile

    clients = max(int(c) for c in args.clients.split(","))
    rng = random.Random(args.seed)
    reqs = make_requests(args.soak, args.seed, args.min_tokens, args.max_tokens)
    kinds = rng.choices([k for k, _ in SOAK_MIX], weights=[w for _, w in SOAK_MIX], k=args.soak)
    log = tempfile.TemporaryFile("w+")
    proc, url, model = start("edgellm", args, clients, stderr=log)
    t0 = time.perf_counter()
    try:
        results, samples = asyncio.run(soak_load(url, model, list(zip(reqs, kinds)), clients, proc.pid, args.seed))
        wall = time.perf_counter() - t0
        g = {}
        for _ in range(120):  # the server notices the last disconnects at its next token or ping
            g = engine_gauges(url)
            if not (g["edgellm_requests_running"] or g["edgellm_requests_waiting"]
                    or g["edgellm_http_requests_in_flight"]):
                break
            time.sleep(0.25)
        rss_idle = psutil_rss(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "killed"
    log.seek(0)
    stderr = log.read()

    errors = [r for r in results if "error" in r]
    gone = sum(1 for r in results if r.get("how") == "gone")
    ended = {}
    for r in results:
        if r.get("how") not in (None, "gone"):
            ended[r["how"]] = ended.get(r["how"], 0) + 1
    finished = {k.split("=")[1].rstrip("}"): int(v) for k, v in g.items()
                if k.startswith("edgellm_requests_finished_total{")}
    http_errors = {k: int(v) for k, v in g.items() if k.startswith("edgellm_request_errors_total{") and v}
    # RSS: the plateau over the first 100 requests (from the 50th on, after the first batches of
    # each shape) against the last 100 and the idle end
    first = [rss for n, rss in samples if min(50, args.soak // 4) <= n <= min(100, args.soak // 2)]
    last = [rss for n, rss in samples if n >= args.soak - min(100, args.soak // 2)] + [rss_idle]
    plateau, end = max(first), max(last)
    blocks = (g["edgellm_kv_blocks_used"], g["edgellm_kv_blocks_cached"], g["edgellm_kv_blocks_free"],
              g["edgellm_kv_blocks_total"])
    checks = {
        "0 unexpected errors": not errors and not http_errors,
        "0 running, 0 waiting, 0 in flight": not (g["edgellm_requests_running"] or g["edgellm_requests_waiting"]
                                                  or g["edgellm_http_requests_in_flight"]),
        "0 KV blocks held; cached + free = total": blocks[0] == 0 and blocks[1] + blocks[2] == blocks[3],
        "every request counted once": sum(finished.values()) == args.soak,
        "cancelled = clients that left": finished.get("cancelled", 0) == gone,
        "stop + length = answers read to the end": all(finished.get(k, 0) == n for k, n in ended.items()),
        "RSS within 5%": end <= 1.05 * plateau,
        "exit 0 on SIGTERM, no traceback": rc == 0 and "Traceback" not in stderr and "ERROR" not in stderr,
    }
    ok = all(checks.values())
    mib = 2**20
    mix = ", ".join(f"{k} {sum(1 for r in results if r['kind'] == k)}" for k, _ in SOAK_MIX)
    print(f"soak: {args.soak} requests from {clients} clients in {wall:.0f} s: {gone} left early "
          f"({mix}); "
          f"{len(errors)} unexpected errors; HTTP errors {http_errors or 0}")
    print(f"  finished by reason (server): {finished}; read to the end (clients): {ended}")
    print(f"  after: running {g['edgellm_requests_running']:.0f}, waiting {g['edgellm_requests_waiting']:.0f}, "
          f"in flight {g['edgellm_http_requests_in_flight']:.0f}; KV blocks used {blocks[0]:.0f}, cached "
          f"{blocks[1]:.0f}, free {blocks[2]:.0f} of {blocks[3]:.0f}; preemptions {g.get('edgellm_preemptions_total', 0):.0f}")
    print(f"  RSS: plateau over requests {min(50, args.soak // 4)}-{min(100, args.soak // 2)} {plateau / mib:.1f} MiB, "
          f"max over the last {min(100, args.soak // 2)} and idle {end / mib:.1f} MiB ({100 * (end / plateau - 1):+.1f}%), "
          f"idle {rss_idle / mib:.1f} MiB; {len(samples)} samples")
    print(f"  server exit {rc}")
    for name, good in checks.items():
        print(f"  {'ok  ' if good else 'FAIL'} {name}")
    for e in errors[:5]:
        print(f"  error ({e['kind']}): {e['error']}")
    if "Traceback" in stderr or "ERROR" in stderr:
        print(stderr[-3000:])
    return 0 if ok else 1


def psutil_rss(pid: int) -> int:
    import psutil

    return psutil.Process(pid).memory_info().rss


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
    ap.add_argument("--llama-server", action="store_true",
                    help="also run llama.cpp's llama-server (implied by --llama-bin)")
    llamacpp.add_argument(ap)
    ap.add_argument("--no-edgellm", action="store_true", help="only llama-server")
    ap.add_argument("--url", default=None, help="a server already running (skips starting any)")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--soak", type=int, default=0, metavar="N",
                    help="instead: N requests from the largest client count against edgellm serve, 40%% of them "
                         "left early (a stream closed after 1-8 tokens or before the first, a non-streamed "
                         "request given up after 0.1-2 s); checks that nothing stays held (slots, KV blocks, "
                         "requests), every request is counted once, RSS stays within 5%%, exit 0 on SIGTERM")
    ap.add_argument("--first-run", type=int, default=0, metavar="N",
                    help="no warm-up request: the --requests are a fresh server's first, then N more on it (warm), "
                         "each series with its own prompt prefix")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started here (finally blocks)

    if args.soak:
        return soak(args)
    requests = make_requests(args.requests, args.seed, args.min_tokens, args.max_tokens,
                             series="Series A. " if args.first_run else "")
    kinds = [] if args.url else (["edgellm"] if not args.no_edgellm else []) + (
        ["llama-server"] if args.llama_server or args.llama_bin else [])
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
                if args.first_run:  # the fresh server's first requests, then as many again warm
                    first = {"server": kind, **asyncio.run(run_load(url, model, requests, clients, args.ignore_eos))}
                    first["phase"] = "first"
                    rows.append(first)
                    print_row(first, args)
                    warm = make_requests(args.first_run, args.seed, args.min_tokens, args.max_tokens,
                                         series="Series B. ")
                    row = {"server": kind, "phase": "warm",
                           **asyncio.run(run_load(url, model, warm, clients, args.ignore_eos))}
                else:
                    asyncio.run(run_load(url, model, requests[:1], 1, args.ignore_eos))  # warm-up
                    row = {"server": kind, **asyncio.run(run_load(url, model, requests, clients, args.ignore_eos))}
            finally:
                if proc is not None:
                    proc.terminate()
                    proc.wait(30)
            rows.append(row)
            print_row(row, args)
        ratio = ratios(rows, clients)
        if ratio and not args.json:
            print(f"{'ratio':>12} clients {clients:>2}: tok/s {ratio['tokens_per_s']:.2f}x (goal >= 1.0)  TTFT p50 "
                  f"{ratio['ttft_p50']:.2f}x p99 {ratio['ttft_p99']:.2f}x (goal <= 1.5)  TPOT p50 "
                  f"{ratio['tpot_p50_ms']:.2f}x p99 {ratio['tpot_p99_ms']:.2f}x  (edgellm / llama-server)", flush=True)
    if args.json:
        print(json.dumps({"rows": rows, "ratios": {c: ratios(rows, c) for c in {r["clients"] for r in rows}}}, indent=1))
    elif len(kinds) == 2:
        print(table(rows))
    return 0


def print_row(row: dict, args) -> None:
    if args.json:
        return
    phase = f" ({row['phase']})" if "phase" in row else ""
    print(f"{row['server']:>12} clients {row['clients']:>2}{phase}: {row['tokens_per_s']:6.1f} tok/s  "
          f"TTFT p50 {row['ttft_p50']:.2f} s p99 {row['ttft_p99']:.2f} s  "
          f"TPOT p50 {row['tpot_p50_ms']:.0f} ms p99 {row['tpot_p99_ms']:.0f} ms  "
          f"errors {row['errors']} ({row['tokens']} tokens in {row['wall_s']:.1f} s)", flush=True)
    for e in row["error_examples"]:
        print(f"             error: {e}", flush=True)


def ratios(rows: list[dict], clients: int) -> dict | None:
    """edgellm / llama-server for each figure at a client count (tokens/s: higher is better; times:
    lower is better); None unless both ran."""
    by = {r["server"]: r for r in rows if r["clients"] == clients}
    if "edgellm" not in by or "llama-server" not in by:
        return None
    e, l = by["edgellm"], by["llama-server"]
    return {k: e[k] / l[k] if l[k] else float("nan")
            for k in ("tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50_ms", "tpot_p99_ms")}


def table(rows: list[dict]) -> str:
    """A Markdown table of both servers per client count, with the ratios."""
    out = ["| clients | tok/s edgellm / llama-server (ratio) | TTFT p50 s | TTFT p99 s (ratio) | TPOT p50 ms | "
           "TPOT p99 ms | errors |", "|---|---|---|---|---|---|---|"]
    for c in sorted({r["clients"] for r in rows}):
        by = {r["server"]: r for r in rows if r["clients"] == c}
        e, l, q = by["edgellm"], by["llama-server"], ratios(rows, c)
        out.append(f"| {c} | {e['tokens_per_s']:.1f} / {l['tokens_per_s']:.1f} ({q['tokens_per_s']:.2f}x) | "
                   f"{e['ttft_p50']:.2f} / {l['ttft_p50']:.2f} | {e['ttft_p99']:.2f} / {l['ttft_p99']:.2f} "
                   f"({q['ttft_p99']:.2f}x) | {e['tpot_p50_ms']:.0f} / {l['tpot_p50_ms']:.0f} | "
                   f"{e['tpot_p99_ms']:.0f} / {l['tpot_p99_ms']:.0f} | {e['errors']} / {l['errors']} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
