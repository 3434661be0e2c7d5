"""Many callers on one model: N threads each calling `generate` (n_seq=N) against one
`generate_batch` of the same prompts, alternating round by round; aggregate generated tokens/s
and the ratio of the medians (threads / batch).

    python scripts/bench/bench_callers.py [MODEL] [--callers 8] [--rounds 6] [-n 128] [-t 2]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import edgellm

SUBJECTS = ["cat", "dog", "robot", "teacher", "sailor", "baker", "pilot", "farmer", "doctor", "miner",
            "painter", "judge", "clown", "monk", "chef", "knight"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None, help="GGUF file or known name (default: the default model)")
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("-n", type=int, default=128, help="tokens per answer (ignore_eos)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    n = a.callers
    prompts = [f"Write a short story about a {SUBJECTS[i % len(SUBJECTS)]} who learns to code." for i in range(n)]
    kw = dict(max_tokens=a.n, temperature=0, ignore_eos=True)
    with edgellm.load(a.model, n_seq=n, threads=a.threads) as m:
        m.generate_batch(prompts[:2], max_tokens=8)  # first steps out of the timings

        def batch() -> float:
            t0 = time.perf_counter()
            m.generate_batch(prompts, **kw)
            return n * a.n / (time.perf_counter() - t0)

        def callers() -> float:
            def one(i: int) -> None:
                for _ in m.generate(prompts[i], **kw):
                    pass
            threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return n * a.n / (time.perf_counter() - t0)

        runs: dict[str, list[float]] = {"batch": [], "callers": []}
        for r in range(a.rounds):
            order = ("batch", "callers") if r % 2 == 0 else ("callers", "batch")
            for side in order:
                runs[side].append(batch() if side == "batch" else callers())
                print(f"round {r} {side:>7}: {runs[side][-1]:6.1f} t/s", flush=True)
    b, c = statistics.median(runs["batch"]), statistics.median(runs["callers"])
    print(f"median generate_batch {b:.1f} t/s, {n} threads calling generate {c:.1f} t/s: {c / b:.3f}x")


if __name__ == "__main__":
    main()
