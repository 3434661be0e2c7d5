"""CPU time to the "prompt longer than the context" error for a huge prompt (developer tool).

    python scripts/bench/bench_long_prompt.py MODEL.gguf [--mb 50] [--ctx 4096] [--base REV] [--base-mb N]

After: `Model.generate(text)` as it is (the tokenizer stops as soon as the prompt cannot fit).
Before: the tokenizer at git revision REV (default main) tokenizing the whole prompt, which is what
generate did before the scheduler refused it (--base-mb: a smaller prompt for the base, when the
full one would take too long or too much memory; its time is then scaled by the size ratio).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LINE = "All work and no play makes Jack a dull boy. The quick brown fox jumps over 13 lazy dogs.\n"


def main(argv=None) -> int:
    import edgellm
    from edgellm.errors import ContextFullError

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--base", default="main")
    ap.add_argument("--base-mb", type=float)
    args = ap.parse_args(argv)
    text = LINE * int(args.mb * 2**20 / len(LINE))
    m = edgellm.load(args.model, n_ctx=args.ctx, threads=1)
    t0 = time.process_time()
    try:
        m.generate(text, max_tokens=1)
        print("after: no error?")
    except ContextFullError as exc:
        print(f"after: {time.process_time() - t0:.3f} s CPU to the error ({len(text) / 2**20:.0f} MiB prompt): {exc}")
    src = subprocess.run(["git", "show", f"{args.base}:edgellm/tokenizer.py"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    old = sys.modules["tokenizer_base"] = types.ModuleType("tokenizer_base")
    exec(compile(src, "tokenizer_base.py", "exec"), old.__dict__)
    tok = old.Tokenizer.from_metadata(m.metadata)
    base_text = text if args.base_mb is None else text[: int(args.base_mb * 2**20)]
    t0 = time.process_time()
    n = len(tok.tokenize(base_text, add_special=True, parse_special=True))
    dt = time.process_time() - t0
    scale = len(text) / len(base_text)
    print(f"before: {dt:.2f} s CPU to tokenize {len(base_text) / 2**20:.1f} MiB ({n} tokens)"
          + (f"; x{scale:.0f} for the whole prompt: ~{dt * scale:.0f} s" if scale > 1 else ""))
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
