"""llama.cpp's `llama-speculative` (a draft model) on the prompts of scripts/bench/spec_draft.py,
over draft lengths, beside its plain decode (`llama-bench -n`): decode tokens/s and acceptance, to
set against edgellm's numbers from that script (same files, threads and prompts). Usage:
    python scripts/vs_llamacpp/spec_vs_llamacpp.py [TARGET] [DRAFT] --llama-bin DIR
        [--threads 2] [--tokens 128] [--prompts 5] [--n-max 2,4,8,16]
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import llamacpp  # noqa: E402
from spec_draft import ASKS, add_pair_arguments  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_pair_arguments(ap, prompts=5)
    ap.add_argument("--n-max", default="2,4,8,16")
    llamacpp.add_argument(ap)
    a = ap.parse_args()
    import edgellm
    from edgellm.fetch import resolve_model

    target, draft = resolve_model(a.target), resolve_model(a.draft)
    spec_tool = llamacpp.tool("llama-speculative", a.llama_bin)
    bench_tool = llamacpp.tool("llama-bench", a.llama_bin)
    env = llamacpp.env_for(spec_tool)
    out = subprocess.run([str(bench_tool), "-m", str(target), "-p", "0", "-n", str(a.tokens), "-t", str(a.threads),
                          "-r", "3", "-o", "csv"], capture_output=True, text=True, env=env, check=True).stdout
    plain = float(out.strip().splitlines()[-1].split(",")[-2].strip('"'))
    print(f"llama-bench tg{a.tokens}: {plain:.1f} tok/s (plain decode)")
    m = edgellm.load(target, n_ctx=64)
    prompts = [m.render_chat([{"role": "user", "content": f"Write {ask}."}]) for ask in ASKS[:a.prompts]]
    m.close()
    for n_max in [int(x) for x in a.n_max.split(",")]:
        toks = secs = drafted = accepted = 0
        for p in prompts:
            r = subprocess.run([str(spec_tool), "-m", str(target), "-md", str(draft), "-p", p, "-n", str(a.tokens),
                                "--temp", "0", "-t", str(a.threads), "-td", str(a.threads), "-c", "1024",
                                "--spec-draft-n-max", str(n_max), "--seed", "1"],
                               capture_output=True, text=True, env=env)
            log = r.stdout + r.stderr
            dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
            if r.returncode != 0 or dec is None:
                raise SystemExit(f"llama-speculative failed (rc {r.returncode}):\n{log[-2000:]}")
            toks += int(dec.group(1))
            secs += float(dec.group(2))
            drafted += int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1))
            accepted += int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1))
        rate = toks / secs
        print(f"llama-speculative --spec-draft-n-max {n_max:2d}: {rate:5.1f} tok/s = {rate / plain:.2f}x plain, "
              f"accepted {accepted}/{drafted} ({100 * accepted / max(drafted, 1):.0f} %)", flush=True)


if __name__ == "__main__":
    main()
