"""Time a first run on a fresh kernel cache: the README's `edgellm run` command, with the kernels
compiled in parallel worker processes (the default) and in the process itself
(EDGELLM_NO_PRECOMPILE=1), alternating, each on its own empty NUMBA_CACHE_DIR.

    python scripts/cold_start.py [--rounds 2] [--model smollm2-135m] [-- extra run flags]

Prints per run: wall seconds to the end of the (one-token) answer, CPU seconds of the command and
its children, and the workers' CPU seconds. On a busy machine the wall time is inflated; the
critical path of the parallel run (the slowest worker plus the serial part) is what an idle
machine with one core per worker would take.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def one(mode: str, model: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="edgellm-cold-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        if mode == "serial":
            env["EDGELLM_NO_PRECOMPILE"] = "1"
        cmd = [sys.executable, "-m", "edgellm.cli", "run", model, "-p", "Write a haiku about memory.",
               "-n", "1", "-v", *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:
        sys.exit(r.stderr)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    workers = [float(v) for line in r.stderr.splitlines() if "workers' CPU seconds" in line
               for v in line.split(":")[-1].split(",")]
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "workers_cpu_s": workers,
            "critical_path_s": cpu - sum(workers) + max(workers) if workers else cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    for _ in range(a.rounds):
        for mode in ("serial", "parallel"):
            res = one(mode, a.model, a.extra)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()
                           if k != "workers_cpu_s"), "workers_cpu_s=" + ",".join(f"{w:.1f}" for w in res["workers_cpu_s"]),
                  flush=True)


if __name__ == "__main__":
    main()
