"""Many sequences, side by side: edgellm's engine and llama.cpp's llama-batched-bench (dev only) on the
same GGUF file and thread count, alternating runs, medians, S_TG ratios per npl; and continuous vs
static batching on a mixed-length workload.

    python scripts/vs_llamacpp/bench_batched.py MODEL --batched-bench [--llama-bin DIR] \
        [--npp 16] [--ntg 96] [--npl 1,2,4,8] [-t 2] [-r 3]
    python scripts/vs_llamacpp/bench_batched.py MODEL --policies [--requests 32] [--n-seq 8]

Each edgellm measurement runs in a fresh subprocess (one load, a warm-up row, then the rows);
llama-batched-bench (in --llama-bin DIR, $LLAMA_BIN or PATH: scripts/llamacpp.py) runs as its own
process (`-npp -ntg -npl -t`, its default f16 cache, no shared prompt), and its S_TG column is
parsed from the markdown table it prints.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-batched-bench)

WORKER = r'''
import json, sys
import edgellm
from edgellm.commands.bench_parallel import bench_parallel
path, npp, ntg, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
npls = [int(x) for x in sys.argv[5].split(",")]
m = edgellm.load(path, n_ctx=npp + ntg + 16, n_batch=512, n_seq=max(npls), threads=threads)
bench_parallel(m, max(npls), npp, 8)  # warm-up: kernels of every batch size
print("RESULT " + json.dumps([bench_parallel(m, n, npp, ntg) for n in npls]))
'''

POLICY_WORKER = r'''
import json, sys, time
import numpy as np
import edgellm
path, n_req, n_seq, threads, policy = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
rng = np.random.default_rng(0)
lens = rng.integers(16, 513, size=n_req)  # max_tokens drawn from 16..512
m = edgellm.load(path, n_ctx=600, n_batch=256, n_seq=n_seq, threads=threads, policy=policy)
prompts = [[int(t) for t in rng.integers(100, m.n_vocab - 100, size=24)] for _ in range(n_req)]
t0 = time.perf_counter()
reqs = [m.submit(p, max_tokens=int(n), temperature=0, ignore_eos=True) for p, n in zip(prompts, lens)]
for r in reqs:
    for _ in r:
        pass
dt = time.perf_counter() - t0
ttft = sorted(r.stats.ttft_s for r in reqs)
print("RESULT " + json.dumps({"policy": policy, "seconds": dt, "req_per_s": n_req / dt,
                              "tok_per_s": int(lens.sum()) / dt, "ttft_median_s": ttft[len(ttft) // 2]}))
'''


def result(out: str) -> object:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(out[-3000:])


def edgellm_rows(path, npp, ntg, threads, npls):
    r = subprocess.run([sys.executable, "-c", WORKER, path, str(npp), str(ntg), str(threads), npls],
                       capture_output=True, text=True)
    return {row["npl"]: row["s_tg"] for row in result(r.stdout + r.stderr)}


def llama_rows(exe: Path, path, npp, ntg, threads, npls):
    r = subprocess.run([str(exe), "-m", path, "-npp", str(npp), "-ntg", str(ntg), "-npl", npls, "-t", str(threads),
                        "-c", str(max(int(n) for n in npls.split(",")) * (npp + ntg) + 64)],
                       capture_output=True, text=True, env=llamacpp.env_for(exe))
    rows = {}
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0]):
            # PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s
            rows[int(cells[2])] = float(cells[7])
    if not rows:
        raise SystemExit(r.stdout[-2000:] + r.stderr[-2000:])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batched-bench", action="store_true",
                    help="also run llama.cpp's llama-batched-bench (implied by --llama-bin)")
    llamacpp.add_argument(ap)
    ap.add_argument("--npp", type=int, default=16)
    ap.add_argument("--ntg", type=int, default=96)
    ap.add_argument("--npl", default="1,2,4,8")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("--policies", action="store_true", help="continuous vs static on a mixed workload")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--n-seq", type=int, default=8)
    args = ap.parse_args()
    path = args.model
    if not os.path.exists(path):
        from edgellm.fetch import model_path

        path = str(model_path(path))
    if args.policies:
        for policy in ("continuous", "static"):
            r = subprocess.run([sys.executable, "-c", POLICY_WORKER, path, str(args.requests), str(args.n_seq),
                                str(args.threads), policy], capture_output=True, text=True)
            print(json.dumps(result(r.stdout + r.stderr)))
        return 0
    exe = llamacpp.tool("llama-batched-bench", args.llama_bin) if args.batched_bench or args.llama_bin else None
    ours, theirs = [], []
    for i in range(args.rounds):
        ours.append(edgellm_rows(path, args.npp, args.ntg, args.threads, args.npl))
        if exe:
            theirs.append(llama_rows(exe, path, args.npp, args.ntg, args.threads, args.npl))
        print(f"round {i + 1}: edgellm {ours[-1]}  llama.cpp {theirs[-1] if theirs else '-'}", file=sys.stderr)
    print(f"{'npl':>4} {'edgellm S_TG':>13} {'llama.cpp S_TG':>15} {'ratio':>6}")
    for n in ours[0]:
        a = statistics.median(r[n] for r in ours)
        b = statistics.median(r[n] for r in theirs) if theirs else float("nan")
        print(f"{n:>4} {a:>13.1f} {b:>15.1f} {a / b:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
