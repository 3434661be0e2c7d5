"""CPU time of a decode step with and without the fused block's shape guard (developer tool).

    python scripts/bench_shape_checks.py MODEL.gguf [--steps 64] [--rounds 6] [--base REV]

A: CPUBackend as it is (decode_block checks the block against its scratch and caches when they
change: per step, one identity and three shape comparisons per layer). B: decode_block and
_fused_plan as they were at git revision REV (default main), with no guard. Rounds alternate A and
B in one process on one model; each round decodes `steps` tokens one at a time (Model.eval) after
a reset, and the median CPU time per step (time.process_time: the machine may be shared) is printed.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    import edgellm
    from edgellm.kernels.cpu.backend import CPUBackend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--base", default="main")
    args = ap.parse_args(argv)
    src = subprocess.run(["git", "show", f"{args.base}:kernels/cpu/backend.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    old = sys.modules["backend_cpu_base"] = types.ModuleType("backend_cpu_base")
    exec(compile(src, "backend_cpu_base.py", "exec"), old.__dict__)
    versions = {"A (guard)": (CPUBackend.decode_block, CPUBackend._fused_plan),
                "B (base)": (old.CPUBackend.decode_block, old.CPUBackend._fused_plan)}
    m = edgellm.load(args.model, n_ctx=args.steps + 8, threads=1)
    backends = {id(b): b for b in m.runtime.model.layer_backends}.values()
    per_step = {k: [] for k in versions}
    for r in range(args.rounds + 1):
        order = list(versions.items())
        for name, (decode_block, fused_plan) in (order if r % 2 else order[::-1]):  # ABBA: no order bias
            CPUBackend.decode_block, CPUBackend._fused_plan = decode_block, fused_plan
            for b in backends:
                b._fused.clear()
            m.reset()
            m.eval([1])
            t0 = time.process_time()
            for t in range(args.steps):
                m.eval([2 + t])
            if r:  # round 0 warms up
                per_step[name].append((time.process_time() - t0) / args.steps * 1000)
    for name, v in per_step.items():
        print(f"{name}: median {statistics.median(v):.3f} ms CPU per step over {args.rounds} rounds: "
              + " ".join(f"{x:.3f}" for x in v))
    a, b = (statistics.median(v) for v in per_step.values())
    print(f"A / B = {a / b:.4f}")
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
