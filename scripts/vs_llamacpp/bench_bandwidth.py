"""Decode weight bandwidth of edgellm and llama.cpp as shares of the memory read rate measured
beside each run (dev only).

    python scripts/vs_llamacpp/bench_bandwidth.py FILE [FILE ...] [--llama-bin DIR] [-n 32] [-r 3] [-t 2]

On a shared or virtual machine the memory read rate moves with the neighbours (on one 2-core VM,
44 GB/s at one hour, 33 the next), so a share against a rate measured at another time is off by as
much. Each round here runs the stream test (`edgellm.machine.stream_bandwidth`), edgellm's
decode (`edgellm bench -p 0 --json`), the stream test, llama-bench's decode, the stream test; each
engine's weights GB/s (bytes of weights a decode step reads x tokens/s) is divided by the mean of the
two stream tests around it. Prints every round and the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from edgellm.machine import stream_bandwidth

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-bench)


def _json(cmd: list[str], env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    llamacpp.add_argument(ap)
    ap.add_argument("-n", type=int, default=32, help="tokens decoded per run")
    ap.add_argument("-r", type=int, default=3, help="rounds")
    ap.add_argument("-t", type=int, default=2, help="threads")
    a = ap.parse_args()
    llama_bench = llamacpp.tool("llama-bench", a.llama_bin)
    env = llamacpp.env_for(llama_bench)
    for path in a.files:
        shares = {"edgellm": [], "llama.cpp": []}
        for _ in range(a.r):
            b0 = stream_bandwidth(a.t)
            ours = _json(["edgellm", "bench", path, "-p", "0", "-n", str(a.n), "-r", "1", "-t", str(a.t), "--json"])
            b1 = stream_bandwidth(a.t)
            theirs = _json([str(llama_bench), "-m", path, "-p", "0", "-n", str(a.n), "-r", "1", "-t", str(a.t),
                            "-o", "json"], env)
            b2 = stream_bandwidth(a.t)
            per_pass = ours["weight_bytes_per_pass"]
            e, ll = ours["results"][0]["tokens_per_s"], theirs[0]["avg_ts"]
            shares["edgellm"].append(e * per_pass / ((b0 + b1) / 2))
            shares["llama.cpp"].append(ll * per_pass / ((b1 + b2) / 2))
            print(f"{os.path.basename(path)}: memory {b0 / 1e9:.1f} / {b1 / 1e9:.1f} / {b2 / 1e9:.1f} GB/s; "
                  f"edgellm {e:.2f} t/s = {e * per_pass / 1e9:.1f} GB/s ({100 * shares['edgellm'][-1]:.0f} %), "
                  f"llama.cpp {ll:.2f} t/s = {ll * per_pass / 1e9:.1f} GB/s ({100 * shares['llama.cpp'][-1]:.0f} %)",
                  flush=True)
        print(f"{os.path.basename(path)}: median share edgellm {100 * statistics.median(shares['edgellm']):.0f} %, "
              f"llama.cpp {100 * statistics.median(shares['llama.cpp']):.0f} %", flush=True)


if __name__ == "__main__":
    main()
