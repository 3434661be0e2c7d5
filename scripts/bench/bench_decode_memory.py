#!/usr/bin/env python
"""Decode products read from memory, not the cache (dev only): the weight bandwidth of one
product kernel against the machine's stream test, the kernels' variants alternating in one
process, medians.

Many copies of one matrix (together at least twice the largest cache, `--mib` at least) are
multiplied by one token's activations in turn, so every product reads its weights from memory as a
decode step does. Reported: GB/s of weights read per second of wall time, and its share of the
stream test (`edgellm bench`'s, run between the rounds).

    python scripts/bench/bench_decode_memory.py [--threads 2] [--rounds 5] [--mib 1024]
        [--kinds q4_k8,q8_0,q6_k,q5_k,q4_0] [--shape 8192x2048] [--cached]

Kinds: q4_k8 = the packed Q4_K rows, eight a kernel call (ir.packed.il8_q4_k: what decode runs); q8_0 =
the eight-row Q8_0 kernel (ir.rows8.rows8_q8_0); q6_k, q5_k = the one-row kernels (ir.kquants.rowdot_q6_k /
_q5_k, 16 rows a parallel item, as kquants.matvec_q6_k); q4_0 = the eight-row Q4_0 kernel
(ir.rows8.rows8_q4_0). "KIND@A" compiles KIND with another software prefetch: for q4_k8 A super-blocks
ahead (ir.packed.PACKED_AHEAD), for q6_k / q5_k A bytes ahead (ir.builder.ROW_AHEAD), for q4_0 A = 1 / 0
with / without the prefetch of the group after the next (ir.rows8.GROUP_AHEAD); 0 emits no prefetch,
e.g. q4_k8@0,q4_k8@3. Every variant's result is checked bit for bit against the first's of its type.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from quant_blocks import random_rows


def kernels() -> dict:
    from edgellm.kernels.cpu.common import U, njit, prange
    from edgellm.kernels.cpu.ir.kquants import rowdot_q5_k, rowdot_q6_k
    from edgellm.kernels.cpu.ir.packed import il8_q4_k
    from edgellm.kernels.cpu.ir.rows8 import rows8_q4_0, rows8_q8_0

    @njit(nogil=True, parallel=True)
    def q4_k8(ws, xq, xd, xs, out):
        nb, rb = U(xd.size), U(ws.shape[2])
        for m in range(ws.shape[0]):
            w = ws[m]
            for g in prange(w.shape[0] // 8):
                il8_q4_k(w, U(g) * U(8) * rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))

    @njit(nogil=True, parallel=True)
    def q8_0(ws, xq, xd, xs, out):
        nb, rb = U(xd.size), U(ws.shape[2])
        for m in range(ws.shape[0]):
            w = ws[m]
            for g in prange(w.shape[0] // 8):
                rows8_q8_0(w, U(g) * U(8) * rb, rb, xq, U(0), xd, U(0), nb, out, U(g) * U(8))

    @njit(nogil=True, parallel=True)
    def q4_0(ws, xq, xd, xs, out):
        nb, rb = U(xd.size), U(ws.shape[2])
        for m in range(ws.shape[0]):
            w = ws[m]
            for g in prange(w.shape[0] // 8):
                rows8_q4_0(w, U(g) * U(8) * rb, rb, xq, xd, xs, U(0), nb, out, U(g) * U(8))

    def one_row(rowdot):
        """A product by a one-row K-quant kernel, 16 rows a parallel item (as kquants.matvec_q6_k)."""
        @njit(nogil=True, parallel=True)
        def product(ws, xq, xd, xs, out):
            nb, rb, n = U(xd.size), U(ws.shape[2]), ws.shape[1]
            for m in range(ws.shape[0]):
                w = ws[m]
                for c in prange((n + 15) // 16):
                    for r in range(c * 16, min(c * 16 + 16, n)):
                        out[r] = rowdot(w, U(r) * rb, xq, U(0), xd, xs, U(0), nb)

        return product

    return {"q4_k8": q4_k8, "q8_0": q8_0, "q6_k": one_row(rowdot_q6_k), "q5_k": one_row(rowdot_q5_k), "q4_0": q4_0}


def compiled(kind: str, *args):
    """The kernel of `kind` ("name", or "name@A": compiled with prefetch setting A, see the module's
    doc), called once on args (so compiled before it is timed)."""
    from edgellm.kernels.cpu.ir import builder, packed, rows8

    name, _, ahead = kind.partition("@")
    mod, attr = ((packed, "PACKED_AHEAD") if name.startswith("q4_k") else (rows8, "GROUP_AHEAD") if name == "q4_0"
                 else (builder, "ROW_AHEAD"))
    saved = getattr(mod, attr)
    if ahead:
        setattr(mod, attr, int(ahead))
    try:
        f = kernels()[name]
        f(*args)
    finally:
        setattr(mod, attr, saved)
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mib", type=int, default=1024, help="weights read per product pass, at least")
    ap.add_argument("--kinds", default="q4_k8,q8_0,q6_k,q5_k,q4_0")
    ap.add_argument("--shape", default="8192x2048", help="rows x columns of one matrix")
    ap.add_argument("--cached", action="store_true", help="two copies only: the kernels' rate from the cache")
    args = ap.parse_args()
    import numba
    from gguf import GGMLQuantizationType as GGMLType

    from edgellm.machine import stream_bandwidth, stream_bytes
    from edgellm.kernels import cpu
    from edgellm.kernels.cpu.kquants import pack8_q4_k

    numba.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split("x"))
    kinds = args.kinds.split(",")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(k) * np.where(rng.random(k) < 0.01, 30, 1)).astype(np.float32)
    total = 0 if args.cached else max(args.mib << 20, stream_bytes())
    runs = []
    for t in (GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q6_K, GGMLType.Q5_K, GGMLType.Q4_0):
        mine = [s for s in kinds if s.startswith(t.name.lower())]
        if not mine:
            continue
        w = random_rows(t, n, k, seed=2)
        if t == GGMLType.Q4_K:
            w = pack8_q4_k(w)
        copies = max(2, -(-total // w.nbytes))
        ws = np.empty((copies,) + w.shape, np.uint8)
        ws[:] = w
        xq, xd, xs = cpu.quantize(cpu.activation_format(t), x).parts[:3]
        first = None
        for s in mine:
            out = np.empty(n, np.float32)
            f = compiled(s, ws[:1], xq, xd, xs, out)
            if first is None:
                first = out.copy()
            same = np.array_equal(first.view(np.uint32), out.view(np.uint32))
            runs.append((s, f, ws, (xq, xd, xs), out, same, []))
    stream = []
    reps = 200 if args.cached else 1
    for _ in range(args.rounds):
        for s, f, ws, xs3, out, same, ts in runs:
            t0 = time.perf_counter()
            for _ in range(reps):
                f(ws, *xs3, out)
            ts.append(reps * ws.nbytes / (time.perf_counter() - t0) / 1e9)
        stream.append(stream_bandwidth(args.threads) / 1e9)
    mem = float(np.median(stream))
    print(f"{args.threads} threads, {n} x {k}, stream test {mem:.1f} GB/s (rounds {min(stream):.1f}-{max(stream):.1f})")
    for s, f, ws, xs3, out, same, ts in runs:
        med = float(np.median(ts))
        print(f"{s:7} {ws.nbytes / 2**20:6.0f} MiB  {med:5.1f} GB/s ({min(ts):.1f}-{max(ts):.1f})  "
              f"{100 * med / mem:3.0f} % of the stream test  bit-equal {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
