"""Plain decoding vs prompt lookup (spec_type="ngram-simple") on an "edit this code" prompt: decode
tokens/s of each, greedy, the answers checked equal. Usage:
    python scripts/bench/spec_lookup.py [MODEL] [--threads 2] [--tokens 256] [--repeats 2]"""
from __future__ import annotations

import argparse
import time

import edgellm

CODE = '''def load_rows(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            rows.append(line.split(","))
    return rows


def total(rows, column):
    result = 0.0
    for row in rows:
        result += float(row[column])
    return result


def average(rows, column):
    if not rows:
        return 0.0
    return total(rows, column) / len(rows)
'''
PROMPT = "Rename the variable `rows` to `records` everywhere in this code and show the whole file:\n\n" + CODE


def run(model, prompt, n):
    t = time.perf_counter()
    toks = [c.token for c in model.generate(prompt, max_tokens=n, temperature=0)]
    return toks, time.perf_counter() - t, model.stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from edgellm.fetch import model_path

    path = model_path(a.model) if not a.model.endswith(".gguf") else a.model
    plain = edgellm.load(path, n_ctx=2048, threads=a.threads)
    spec = edgellm.load(path, n_ctx=2048, threads=a.threads, spec_type="ngram-simple")
    prompt = plain.render_chat([{"role": "user", "content": PROMPT}])
    ref = None
    for i in range(a.repeats):
        for name, m in (("plain", plain), ("lookup", spec)):
            toks, _, st = run(m, prompt, a.tokens)
            ref = toks if ref is None else ref
            assert toks == ref, "the answers differ"
            extra = f", draft {st.draft_n_accepted}/{st.draft_n} accepted" if st.draft_n else ""
            print(f"{name:7s} run {i}: {st.gen_tokens} tok, {st.gen_tps:.1f} tok/s{extra}", flush=True)


if __name__ == "__main__":
    main()
