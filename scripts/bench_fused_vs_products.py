#!/usr/bin/env python
"""The fused decode step's layers against the same products run one by one (dev only).

Loads FILE, decodes a few tokens, then alternates in one process: (a) decode steps, timing the
CPU backend's one call of every layer (`CPUBackend.decode_layers`), and (b) every layer matrix's
product with one token (`Matrix.matvec_act`, weights from memory, the same bound arrays the step
reads), plus the output head alone. The step does the products' work and the norms, RoPE,
attention and activation quantizing between them; where (a) is well above (b), the time is lost
outside the row kernels or in them as compiled into the step.

    python scripts/bench_fused_vs_products.py FILE [-t 2] [--rounds 8]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    import edgellm
    from edgellm.kernels.cpu import quantize

    m = edgellm.load(args.model, threads=args.threads, n_ctx=1024)
    m.eval(m.tokenize("The memory of a decode step is mostly its weights."))
    b = m.runtime.backends["cpu"]
    step_times = []
    fused_call = b.decode_layers

    def timed(*a, **k):
        t0 = time.perf_counter()
        r = fused_call(*a, **k)
        step_times.append(time.perf_counter() - t0)
        return r

    b.decode_layers = timed
    mats = [mm for _, mm in b._bound.values()]
    head = max(mats, key=lambda mm: mm.n_rows)
    layers = [mm for mm in mats if mm is not head]
    rng = np.random.default_rng(0)
    acts = {(mm.n_cols, mm.act_format): quantize(mm.act_format, rng.standard_normal(mm.n_cols).astype(np.float32))
            for mm in mats}
    outs = {mm.n_rows: np.empty(mm.n_rows, np.float32) for mm in mats}

    def products(ms) -> float:
        t0 = time.perf_counter()
        for mm in ms:
            mm.matvec_act(acts[(mm.n_cols, mm.act_format)], outs[mm.n_rows])
        return time.perf_counter() - t0

    fused, prods, heads = [], [], []
    for r in range(args.rounds):
        step_times.clear()
        for i in range(3):
            m.eval([100 + 3 * r + i])
        fused.append(float(np.median(step_times)) if step_times else float("nan"))
        prods.append(products(layers))
        heads.append(products([head]))
    mib = sum(mm.weights.nbytes for mm in layers) / 2**20
    f, p, h = (1e3 * float(np.median(v)) for v in (fused, prods, heads))
    print(f"{args.model}, {args.threads} threads, {args.rounds} rounds, medians: fused layers {f:.1f} ms, "
          f"their products one by one {p:.1f} ms ({f / p:.2f}x; {mib:.0f} MiB), output head {h:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
