"""What a grammar costs: decode tokens/s of JSON answers under a JSON schema against the same
requests unconstrained, at 1 and N sequences, and the time to the first token of each. Usage:
    python scripts/bench/grammar_cost.py [MODEL] [--threads 2] [--tokens 96] [--seqs 1,8] [--repeats 3]"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

import edgellm

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "maxItems": 6, "items": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "qty": {"type": "integer"},
        "kind": {"enum": ["book", "pen", "cup", "lamp"]}}, "required": ["title", "qty", "kind"]}},
    "paid": {"type": "boolean"}}, "required": ["name", "items", "paid"]}
ASK = "Describe an order of a few things from a stationery shop, as JSON with a name, items and paid."


def one(model, prompt, n, schema, seed, out):
    t0 = time.perf_counter()
    first, count = None, 0
    for c in model.generate(prompt, max_tokens=n, temperature=0.8, seed=seed, ignore_eos=schema is None,
                            json_schema=schema, cache_prompt=False):  # every request prefills its prompt
        count += 1
        if first is None:
            first = time.perf_counter() - t0
    out.append((first, count, time.perf_counter() - t0 - first))


def batch(model, prompt, n, schema, n_seq, seed0):
    """(aggregate decode tokens/s, median time to first token) of n_seq concurrent requests."""
    out: list = []
    threads = [threading.Thread(target=one, args=(model, prompt, n, schema, seed0 + i, out)) for i in range(n_seq)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    decode_s = max(d for _, _, d in out)
    return sum(c - 1 for _, c, _ in out) / decode_s, statistics.median(f for f, _, _ in out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    seqs = [int(x) for x in args.seqs.split(",")]
    model = edgellm.load(args.model, n_seq=max(seqs), n_ctx=1024, threads=args.threads)
    prompt = model.render_chat([{"role": "user", "content": ASK}])
    model.grammar_vocab  # the vocabulary for the grammar is built once per model, before timing
    batch(model, prompt, 8, SCHEMA, 1, 0)  # warm: kernels of every step size, the grammar's caches
    print(f"{args.model}, {args.threads} threads, {args.tokens} tokens per request, median of {args.repeats}")
    print("n_seq  plain t/s  schema t/s  ratio  ttft plain ms  ttft schema ms")
    for n_seq in seqs:
        plain, cons = [], []
        for r in range(args.repeats):  # alternating, so drift in the machine's speed hits both
            plain.append(batch(model, prompt, args.tokens, None, n_seq, 100 * r))
            cons.append(batch(model, prompt, args.tokens, SCHEMA, n_seq, 100 * r))
        p = statistics.median(x for x, _ in plain)
        c = statistics.median(x for x, _ in cons)
        print(f"{n_seq:5d}  {p:9.1f}  {c:10.1f}  {c / p:5.2f}  {1e3 * statistics.median(f for _, f in plain):13.0f}"
              f"  {1e3 * statistics.median(f for _, f in cons):14.0f}")
    model.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
