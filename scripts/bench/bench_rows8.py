#!/usr/bin/env python
"""A/B of the eight-row 4-bit kernels (kernels/cpu/ir/rows8.py) against the one-row kernels they
replace, per matrix of the Llama-3.2-1B shape: bit-equality and CPU time (process time, so other
work on a shared machine does not count), alternating in one process, medians. Q4_K also times
the packed rows (kquants.pack8_q4_k / matvec_q4_k8, what CPUBackend runs for mapped Q4_K).

    python scripts/bench/bench_rows8.py [--threads 1] [--reps 9] [--kinds q4_0,q4_k]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from quant_blocks import random_rows

SHAPES = ((2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048))


def kernels():
    from edgellm.kernels.cpu.common import U, njit, prange
    from edgellm.kernels.cpu.kquants import row_q4_k
    from edgellm.kernels.cpu.legacy import row_q4_0
    from edgellm.kernels.cpu.ir.rows8 import rows8_q4_0, rows8_q4_k

    @njit(nogil=True, parallel=True)
    def one_q4_0(w, xq, xd, xs, out):
        nb = U(xd.size)
        for r in prange(w.shape[0]):
            out[r] = row_q4_0(w[r], xq, xd, xs, U(0), nb)

    @njit(nogil=True, parallel=True)
    def eight_q4_0(w, xq, xd, xs, out):
        nb, rb = U(xd.size), U(w.shape[1])
        for g in prange(w.shape[0] // 8):
            rows8_q4_0(w, U(g) * U(8) * rb, rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))

    @njit(nogil=True, parallel=True)
    def one_q4_k(w, xq, xd, xs, out):
        nb = U(xd.size)
        for r in prange(w.shape[0]):
            out[r] = row_q4_k(w[r], xq, xd, xs, U(0), nb, False)

    @njit(nogil=True, parallel=True)
    def eight_q4_k(w, xq, xd, xs, out):
        nb, rb = U(xd.size), U(w.shape[1])
        for g in prange(w.shape[0] // 8):
            rows8_q4_k(w, U(g) * U(8) * rb, rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))

    return {"q4_0": (one_q4_0, eight_q4_0), "q4_k": (one_q4_k, eight_q4_k)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kinds", default="q4_0,q4_k")
    args = ap.parse_args()
    import numba
    from edgellm.kernels import cpu
    from gguf import GGMLQuantizationType as GGMLType

    numba.set_num_threads(args.threads)
    ks = kernels()
    rng = np.random.default_rng(1)
    for kind in args.kinds.split(","):
        t = GGMLType.Q4_0 if kind == "q4_0" else GGMLType.Q4_K
        one, eight = ks[kind]
        for n, k in SHAPES:
            w = random_rows(t, n, k, seed=2)
            x = (rng.standard_normal(k) * np.where(rng.random(k) < 0.01, 30, 1)).astype(np.float32)
            xq, xd, xs = cpu.quantize(cpu.activation_format(t), x).parts[:3]
            a, b = np.empty(n, np.float32), np.empty(n, np.float32)
            one(w, xq, xd, xs, a)
            eight(w, xq, xd, xs, b)
            same = np.array_equal(a.view(np.uint32), b.view(np.uint32))
            runs = [(one, w, a, []), (eight, w, b, [])]
            if kind == "q4_k":
                from edgellm.kernels.cpu.kquants import matvec_q4_k8, pack8_q4_k

                p, c = pack8_q4_k(w), np.empty(n, np.float32)
                matvec_q4_k8(p, xq, xd, xs, xs, c)  # (xm: unused by K-quants)
                same = same and np.array_equal(a.view(np.uint32), c.view(np.uint32))
                def packed(p_, xq_, xd_, xs_, out_):
                    matvec_q4_k8(p_, xq_, xd_, xs_, xs_, out_)  # (xm: unused by K-quants)

                runs.append((packed, p, c, []))
            calls = max(3, int(2e8 // w.nbytes))
            for _ in range(args.reps):
                for f, arg, out, ts in runs:
                    t0 = time.process_time()
                    for _ in range(calls):
                        f(arg, xq, xd, xs, out)
                    ts.append((time.process_time() - t0) / calls)
            m1, m8 = (float(np.median(r[3])) for r in runs[:2])
            line = (f"{kind} {n:>6} x {k:<5} bit-equal {same}  one-row {w.nbytes / m1 / 1e9:5.1f} GB/s  "
                    f"eight-row {w.nbytes / m8 / 1e9:5.1f} GB/s  {m1 / m8:4.2f}x")
            if len(runs) > 2:
                mp = float(np.median(runs[2][3]))
                line += f"  packed {w.nbytes / mp / 1e9:5.1f} GB/s  {m8 / mp:4.2f}x of eight-row"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
