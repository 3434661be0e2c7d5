"""A scripted chat through the API: time to first token per turn, with the engine's prefix reuse (each
turn evaluates only its new tokens) and, for comparison, with the cache emptied before every turn.

    python scripts/bench/bench_chat_turns.py [MODEL] [--turns 10] [--answer 60]
"""
from __future__ import annotations

import argparse

import edgellm

QUESTIONS = ["Tell me about the moon.", "Why is the sky blue?", "What is a prime number?",
             "How do bees make honey?", "What causes rain?", "Who wrote Hamlet?", "What is gravity?",
             "How do plants grow?", "What is an atom?", "Why do cats purr?", "What is a volcano?"]


def run(model, turns: int, answer: int, reuse: bool, first: int = 0) -> list[tuple[int, int, float]]:
    messages, rows = [], []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[(first + i) % len(QUESTIONS)]})
        if not reuse:  # forget every cached block: the whole history is evaluated again
            for g in model.runtime.cache.groups:
                while g.pool.lru:
                    g.pool.allocate()
                g.pool.__init__(g.pool.n_blocks, g.pool.block_size)
        req = model.submit(model.render_chat(messages), max_tokens=answer, temperature=0, ignore_eos=True)
        text = req.text()
        messages.append({"role": "assistant", "content": text})
        rows.append((req.stats.prompt_tokens, req.stats.cached_tokens, req.stats.ttft_s))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--answer", type=int, default=60)
    args = ap.parse_args()
    m = edgellm.load(args.model, n_ctx=4096)
    run(m, 2, 8, True, first=5)  # warm-up (other questions: turn 1 below finds nothing cached)
    for reuse in (True, False):
        rows = run(m, args.turns, args.answer, reuse)
        print(f"prefix reuse {'on' if reuse else 'off'}: turn, prompt tokens, cached, TTFT ms")
        for i, (n, c, t) in enumerate(rows, 1):
            print(f"  {i:>2} {n:>6} {c:>6} {1000 * t:>8.1f}")
        print(f"  TTFT turn {args.turns} / turn 1: {rows[-1][2] / rows[0][2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
