#!/usr/bin/env python
"""edgellm's and llama.cpp's decode in one process, a few tokens of each in turn (dev only).

On a VM whose memory rate moves by 1.5x from one minute to the next, two engines timed in
separate processes a minute apart (bench_vs_llamacpp.py) see different machines; here both models
are loaded in one process (llama.cpp through llama-cpp-python, built for AVX2 as docs/performance.md
says) and every round decodes --block tokens with each, so both meet the same minute. The depth
is filled first (a prompt of -d random tokens, each engine in batches), then each engine's tokens
are timed one `eval` at a time (a decode step and its logits; no sampling). Prints the medians per
token and the ratio (llama.cpp's time / edgellm's: above 1, edgellm is faster). With --prompt N,
each round times a prompt of N tokens from an empty context instead (llama-bench's ppN).

    python scripts/vs_llamacpp/bench_decode_interleaved.py MODEL [-t 2] [-d 0] [--rounds 8] [--block 8]
        [--prompt N]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-d", "--depth", type=int, default=0, help="tokens in the context before the timed ones")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=8, help="tokens of one engine in a row")
    ap.add_argument("--prompt", type=int, default=0, help="time prompts of this many tokens instead")
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        print("needs llama-cpp-python in this environment (see docs/performance.md)", file=sys.stderr)
        return 2
    import edgellm

    n_ctx = args.depth + args.rounds * args.block + 64 + args.prompt
    ll = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n_ctx,
               n_batch=512, verbose=False)
    m = edgellm.load(args.model, threads=args.threads, n_ctx=n_ctx)
    rng = np.random.default_rng(0)
    fill = [int(t) for t in rng.integers(100, min(m.n_vocab, ll.n_vocab()) - 100, size=max(args.depth, 1))]
    for i in range(0, len(fill), 512):
        m.eval(fill[i:i + 512])
        ll.eval(fill[i:i + 512])
    times = {"edgellm": [], "llama.cpp": []}
    if args.prompt:
        return prompt_rounds(args, m, ll, rng, times)
    steps = {"edgellm": lambda tok: m.eval([tok]), "llama.cpp": lambda tok: ll.eval([tok])}
    tok = 1000
    for _ in range(args.rounds):
        for name, step in steps.items():
            time.sleep(0.05)  # the other engine's threads settle
            for _ in range(args.block):
                t0 = time.perf_counter()
                step(tok)
                times[name].append(time.perf_counter() - t0)
                tok += 1
    e, lc = (float(np.median(times[k])) for k in ("edgellm", "llama.cpp"))
    print(f"{os.path.basename(args.model)}, {args.threads} threads, depth {args.depth}, {args.rounds} rounds of "
          f"{args.block} tokens each, medians: edgellm {1 / e:.2f} t/s, llama.cpp {1 / lc:.2f} t/s, "
          f"ratio {lc / e:.3f}")
    return 0


def prompt_rounds(args, m, ll, rng, times) -> int:
    """Each round: both engines evaluate the same fresh prompt of args.prompt tokens, in turn."""
    for r in range(args.rounds + 1):
        prompt = [int(t) for t in rng.integers(100, min(m.n_vocab, ll.n_vocab()) - 100, size=args.prompt)]
        for name, engine in (("edgellm", m), ("llama.cpp", ll)):
            engine.reset()
            time.sleep(0.05)
            t0 = time.perf_counter()
            for i in range(0, len(prompt), 512):
                engine.eval(prompt[i:i + 512])
            if r:  # the first round warms both
                times[name].append(time.perf_counter() - t0)
    e, lc = (float(np.median(times[k])) for k in ("edgellm", "llama.cpp"))
    print(f"{os.path.basename(args.model)}, {args.threads} threads, prompt {args.prompt}, {args.rounds} rounds, "
          f"medians: edgellm {args.prompt / e:.1f} t/s, llama.cpp {args.prompt / lc:.1f} t/s, ratio {lc / e:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
