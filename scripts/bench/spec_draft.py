"""Plain decoding vs a draft model (spec type draft-simple) on code-writing prompts: the answers
checked equal token for token (greedy, each prompt evaluated afresh: a cached prefix changes the
batch its last tokens are evaluated in), decode tokens/s of each, proposed / accepted tokens.
Modes: "adaptive" (the engine stands down where drafting does not pay) and "forced" (every step
drafts as many tokens as the verification step holds). Usage:
    python scripts/bench/spec_draft.py [TARGET] [DRAFT] [--threads 2] [--tokens 128] [--prompts 20]
"""
from __future__ import annotations

import argparse
import time

import edgellm
from edgellm import scheduler

ASKS = ["a Python function that checks whether a number is prime", "a C function that reverses a linked list",
        "a JavaScript function that debounces another function", "a Python class for a stack with push and pop",
        "a Rust function that sums a vector of integers", "a Python function that reads a CSV file into dicts",
        "a Go function that reverses a string", "a SQL query that finds duplicate emails in a users table",
        "a Python function for binary search", "a bash script that counts lines in every .py file",
        "a Python function that flattens a nested list", "a Java method that checks for a palindrome",
        "a Python decorator that times a function", "a C++ function that computes a factorial",
        "a Python function that merges two sorted lists", "a TypeScript interface for a user profile",
        "a Python function that counts word frequencies", "a regular expression that matches an email address",
        "a Python generator for Fibonacci numbers", "a Python function that validates an IPv4 address"]


def add_pair_arguments(ap: argparse.ArgumentParser, prompts: int) -> None:
    """The target / draft pair, threads, tokens and prompts (shared with spec_vs_llamacpp.py)."""
    ap.add_argument("target", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("draft", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_pair_arguments(ap, prompts=20)
    ap.add_argument("--modes", default="adaptive,forced")
    a = ap.parse_args()
    plain = edgellm.load(a.target, n_ctx=1024, threads=a.threads)
    spec = edgellm.load(a.target, n_ctx=1024, threads=a.threads, draft=a.draft)
    choose = scheduler.DraftLength.choose
    prompts = [plain.render_chat([{"role": "user", "content": f"Write {ask}."}]) for ask in ASKS[:a.prompts]]
    totals: dict = {}
    for i, p in enumerate(prompts):
        want = None
        for mode in ["plain"] + a.modes.split(","):
            m = plain if mode == "plain" else spec
            scheduler.DraftLength.choose = (lambda self, n: n) if mode == "forced" else choose
            t = time.perf_counter()
            toks = [c.token for c in m.generate(p, max_tokens=a.tokens, temperature=0, cache_prompt=False)]
            wall = time.perf_counter() - t
            want = toks if want is None else want
            assert toks == want, f"prompt {i}: the {mode} answer differs from the plain one"
            st = m.stats
            tot = totals.setdefault(mode, [0, 0.0, 0, 0])
            tot[0] += st.gen_tokens - 1
            tot[1] += st.gen_ms / 1000
            tot[2] += st.draft_n
            tot[3] += st.draft_n_accepted
            print(f"prompt {i:2d} {mode:8s}: {st.gen_tokens} tok, {st.gen_tps:5.1f} tok/s, "
                  f"draft {st.draft_n_accepted}/{st.draft_n}  ({wall:.1f} s)", flush=True)
    scheduler.DraftLength.choose = choose
    base = totals["plain"][0] / totals["plain"][1]
    print(f"\n{len(prompts)} prompts x {a.tokens} tokens, greedy answers equal in every mode")
    for mode, (n, s, dn, da) in totals.items():
        acc = f", accepted {da}/{dn} ({100 * da / dn:.0f} %)" if dn else ""
        print(f"{mode:8s}: {n / s:5.1f} tok/s decode = {n / s / base:.2f}x plain{acc}")


if __name__ == "__main__":
    main()
