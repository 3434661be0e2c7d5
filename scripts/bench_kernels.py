"""Benchmark the CPU kernels: matvec weight bandwidth per type vs. a NumPy sum over the same bytes.

    python scripts/bench_kernels.py [--types Q4_0,Q8_0] [--threads N] [--working-set-mb 192]

For each type: a 4096 x 4096 matrix of random valid blocks, repeated until the working set exceeds
--working-set-mb (so matvec streams from memory, as in decode, not from the last-level cache; pass
0 for a single copy). Columns: GB/s of weight bytes matvec streams, GB/s of `uint64.sum()` over
the same buffers (NumPy, one thread: the machine's streaming bandwidth), the ratio, and matmul
GFLOP/s for n_tok = 512 on one copy. Runs alternate kernel / sum; medians are reported.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_blocks import random_rows  # noqa: E402

from edgellm.kernels import cpu  # noqa: E402

N = 4096


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_type(t, working_set: int, reps: int, matmul_reps: int) -> tuple[float, float, float]:
    first = random_rows(t, N, N, seed=0)
    copies = [first] + [np.roll(first, k, axis=0) for k in range(1, -(-working_set // first.nbytes))]
    x = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    out = np.empty(N, np.float32)
    words = [c.reshape(-1).view(np.uint64) for c in copies]
    total = sum(c.nbytes for c in copies)

    def run_matvec():
        for c in copies:
            cpu.matvec(t, c, x, out)

    def run_sum():
        for w in words:
            w.sum()

    run_matvec()  # compile / load from cache
    mv, sm = [], []
    for _ in range(reps):  # alternate, so both see the same machine load
        mv.append(median_time(run_matvec, 1))
        sm.append(median_time(run_sum, 1))
    xs = np.random.default_rng(2).standard_normal((512, N)).astype(np.float32)
    prod = np.empty((512, N), np.float32)
    cpu.matmul(t, first, xs[:2], prod[:2])
    mm = median_time(lambda: cpu.matmul(t, first, xs, prod), matmul_reps)
    return total / np.median(mv) / 1e9, total / np.median(sm) / 1e9, 2.0 * 512 * N * N / mm / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default=",".join(t.name for t in cpu.supported_types()))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--working-set-mb", type=float, default=192.0)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--matmul-reps", type=int, default=3)
    args = p.parse_args()
    from gguf import GGMLQuantizationType as GGMLType

    if args.threads:
        cpu.set_threads(args.threads)
    import numba

    print(f"matvec {N}x{N}, working set >= {args.working_set_mb:g} MB, "
          f"{numba.get_num_threads()} Numba threads; numpy sum is single-threaded")
    print(f"{'type':6} {'matvec GB/s':>12} {'numpy sum GB/s':>15} {'ratio':>7} {'matmul n_tok=512 GFLOP/s':>26}")
    for name in args.types.split(","):
        t = GGMLType[name.strip()]
        mv, sm, gflops = bench_type(t, int(args.working_set_mb * 2**20), args.reps, args.matmul_reps)
        print(f"{t.name:6} {mv:12.2f} {sm:15.2f} {100 * mv / sm:6.0f}% {gflops:26.1f}", flush=True)


if __name__ == "__main__":
    main()
