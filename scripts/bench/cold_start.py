"""Time a first run on a fresh kernel cache: the README's `edgellm run` command, with the kernels
compiled in parallel worker processes (the default) and in the process itself
(EDGELLM_NO_PRECOMPILE=1), alternating, each on its own empty NUMBA_CACHE_DIR.

    python scripts/bench/cold_start.py [--rounds 2] [--model smollm2-135m] [--download] [-n 40] [-- extra run flags]

Prints per run: seconds to the answer's first byte on stdout (first_token_s) and to the end of
the command (wall_s), CPU seconds of the command and its children, and the workers' CPU seconds.
--download: also an empty model cache (EDGELLM_CACHE), so a known model is downloaded as on a
fresh install (its kernels then compile during the download, from a stand-in).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def one(mode: str, model: str, n: int, download: bool, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="edgellm-cold-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=os.path.join(cache, "numba"))
        if download:
            env["EDGELLM_CACHE"] = os.path.join(cache, "models")
        if mode == "serial":
            env["EDGELLM_NO_PRECOMPILE"] = "1"
        cmd = [sys.executable, "-m", "edgellm.cli", "run", model, "-p", "Write a haiku about memory.",
               "-n", str(n), "-v", *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = p.stdout.read(1)
        t1 = time.perf_counter()
        p.stdout.read()
        err = p.stderr.read().decode(errors="replace")
        p.wait()
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode or not first:
        sys.exit(err)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    workers = [float(v) for line in err.splitlines() if "workers' CPU seconds" in line
               for v in line.split(":")[-1].split(",")]
    return {"mode": mode, "first_token_s": t1 - t0, "wall_s": wall, "cpu_s": cpu, "workers_cpu_s": workers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("-n", type=int, default=1, help="tokens of the answer (default 1)")
    ap.add_argument("--download", action="store_true", help="an empty model cache too: the model is downloaded")
    ap.add_argument("--modes", default="serial,parallel", help="serial (EDGELLM_NO_PRECOMPILE=1), parallel (workers)")
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    for _ in range(a.rounds):
        for mode in a.modes.split(","):
            res = one(mode, a.model, a.n, a.download, a.extra)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()
                           if k != "workers_cpu_s"), "workers_cpu_s=" + ",".join(f"{w:.1f}" for w in res["workers_cpu_s"]),
                  flush=True)


if __name__ == "__main__":
    main()
