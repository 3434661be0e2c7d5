"""edgellm and llama.cpp (llama-cpp-python, or llama.cpp's own llama-bench; dev only) side by side on
the same GGUF file and thread count: pp (batched prompt tokens/s) and tg (one-token decode tokens/s),
alternating runs, medians, ratios; peak RSS of each in its own process.

    python scripts/vs_llamacpp/bench_vs_llamacpp.py MODEL [-p 512] [-n 128] [-r 3] [-t 2] [-d 0]
                                        [--llama-bench] [--llama-bin DIR]

-d N: both tests after N tokens already in the context (llama-bench's -d), filled in batches of
max(p, 512) tokens (llama-bench's default micro-batch is 512). With --llama-bench (implied by
--llama-bin) the llama.cpp side is its llama-bench program, found in --llama-bin DIR, $LLAMA_BIN or
PATH (scripts/llamacpp.py) and run with -r --reps repetitions; without it, llama-cpp-python.

Each measurement runs in a fresh subprocess (so RSS is per engine) that loads the model once, warms
up, then times r repetitions; runs alternate edgellm / llama.cpp to share the machine's noise.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-bench)

WORKER = r'''
import json, sys, time, resource
import numpy as np
engine, path, n_prompt, n_gen, reps, threads, depth = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:8])
fill = max(n_prompt, 512)  # the batch the depth is filled in (and both engines' batch size)
rng = np.random.default_rng(0)
out = {"pp": [], "tg": []}
if engine == "llama-bench":  # path: "MODEL|BINARY"
    import os, subprocess
    model, exe = path.split("|")
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(exe))
    for key, args in (("pp", ["-p", str(n_prompt), "-n", "0"]), ("tg", ["-p", "0", "-n", str(n_gen)])):
        if (n_prompt if key == "pp" else n_gen) == 0:
            continue
        cmd = [exe, "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json", *args]
        if depth:
            cmd += ["-d", str(depth)]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        if r.returncode:
            sys.exit(r.stderr[-2000:])
        out[key] = json.loads(r.stdout)[0]["samples_ts"]
    out["load_s"] = float("nan")
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    print("RESULT " + json.dumps(out))
    sys.exit(0)
if engine == "edgellm":
    import edgellm
    t0 = time.perf_counter()
    m = edgellm.load(path, n_ctx=depth + n_prompt + n_gen + 8, n_batch=fill, threads=threads)
    out["load_s"] = time.perf_counter() - t0
    def reset(): m.reset()
    def ev(ids): m.eval(ids)
    vocab = m.n_vocab
else:
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_ctx=depth + n_prompt + n_gen + 8, n_batch=fill, n_ubatch=fill,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    out["load_s"] = time.perf_counter() - t0
    def reset(): llm.reset()
    def ev(ids): llm.eval(list(map(int, ids)))
    vocab = llm.n_vocab()
for r in range(reps + 1):  # the first repetition warms up
    ids = rng.integers(100, vocab - 100, size=max(n_prompt, n_gen + 1))
    ctx = rng.integers(100, vocab - 100, size=depth)
    def prefill():
        reset()
        for i in range(0, depth, fill):
            ev(ctx[i:i + fill])
    if n_prompt:
        prefill(); t0 = time.perf_counter(); ev(ids[:n_prompt]); dt = time.perf_counter() - t0
        if r: out["pp"].append(n_prompt / dt)
    if n_gen:
        prefill(); ev(ids[:1]); t0 = time.perf_counter()
        for t in ids[1:n_gen + 1]:
            ev([t])
        dt = time.perf_counter() - t0
        if r: out["tg"].append(n_gen / dt)
out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
'''


def run_one(engine: str, path: str, n_prompt: int, n_gen: int, reps: int, threads: int, depth: int) -> dict:
    r = subprocess.run([sys.executable, "-c", WORKER, engine, path, str(n_prompt), str(n_gen), str(reps), str(threads),
                        str(depth)],
                       capture_output=True, text=True)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{engine} failed:\n{r.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3, help="alternating rounds (each a fresh process per engine)")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-d", type=int, default=0, help="tokens already in the context before each test")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions inside each process")
    ap.add_argument("--llama-bench", action="store_true",
                    help="llama.cpp's side from its llama-bench program instead of llama-cpp-python "
                         "(implied by --llama-bin)")
    llamacpp.add_argument(ap)
    args = ap.parse_args()
    from edgellm.fetch import resolve_model

    path = str(resolve_model(args.model))
    llama_bench = llamacpp.tool("llama-bench", args.llama_bin) if args.llama_bench or args.llama_bin else None
    res = {"edgellm": [], "llama.cpp": []}
    for i in range(args.r):
        for engine in ("edgellm", "llama.cpp"):
            t0 = time.perf_counter()
            if engine == "edgellm":
                kind, target = "edgellm", path
            else:
                kind, target = ("llama-bench", f"{path}|{llama_bench}") if llama_bench else ("llamacpp", path)
            res[engine].append(run_one(kind, target, args.p, args.n, args.reps, args.t, args.d))
            print(f"round {i + 1} {engine}: {time.perf_counter() - t0:.1f} s "
                  f"pp {res[engine][-1]['pp']} tg {res[engine][-1]['tg']}", file=sys.stderr)

    def med(engine, key):
        vals = [v for run in res[engine] for v in run[key]]
        return statistics.median(vals) if vals else float("nan")

    print(f"model {path}, threads {args.t}, pp{args.p} / tg{args.n}, depth {args.d}, {args.r} alternating rounds, "
          f"medians")
    print(f"| {'test':>6} | {'edgellm t/s':>12} | {'llama.cpp t/s':>13} | {'ratio':>6} |")
    for key, label in (("pp", f"pp{args.p}"), ("tg", f"tg{args.n}")):
        a, b = med("edgellm", key), med("llama.cpp", key)
        print(f"| {label:>6} | {a:12.2f} | {b:13.2f} | {a / b:6.2f} |")
    ra = statistics.median(r["peak_rss"] for r in res["edgellm"])
    rb = statistics.median(r["peak_rss"] for r in res["llama.cpp"])
    print(f"| {'RSS':>6} | {ra / 2**20:10.1f}Mi | {rb / 2**20:11.1f}Mi | {ra / rb:6.2f} |")
    la = statistics.median(r["load_s"] for r in res["edgellm"])
    lb = statistics.median(r["load_s"] for r in res["llama.cpp"])
    if not math.isnan(lb):  # llama-bench does not report its load time
        print(f"| {'load':>6} | {la:11.2f}s | {lb:12.2f}s | {la / lb:6.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
