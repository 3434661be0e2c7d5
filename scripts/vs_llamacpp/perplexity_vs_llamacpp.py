"""Dev tool: edgellm perplexity / KL next to llama-perplexity's on the same file, text and chunks.

    python scripts/vs_llamacpp/perplexity_vs_llamacpp.py [--llama-bin DIR] MODEL.gguf [--base BASE.gguf] \
        [-c 512] [--chunks 8] [-t 2] [--record NAME]   # --record: store llama's numbers as a test fixture

The text is edgellm's default (Python's pydoc topics), written to a temporary file for llama.cpp.
llama-perplexity runs with -b equal to -c (one chunk per batch, as edgellm evaluates it) and
--flash-attn (default off; llama.cpp's own default "auto" turns flash attention on for the CPU:
SmolLM2 -c 128, 2 chunks: PPL 9.3599 with it, 9.3698 without); edgellm loads with the same
flash_attn (load(flash_attn=...): "on" follows llama.cpp's CPU flash-attention kernels).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-perplexity)

FIXTURE = ROOT / "tests" / "data" / "perplexity_llamacpp.json"


def llama(exe: Path, args: list[str]) -> tuple[str, float]:
    t0 = time.perf_counter()
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, env=llamacpp.env_for(exe))
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return p.stdout + p.stderr, time.perf_counter() - t0


def grab(pattern: str, text: str) -> list[float]:
    m = re.search(pattern, text)
    if not m:
        raise RuntimeError(f"not found in llama-perplexity's output: {pattern}")
    return [float(g) for g in m.groups()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--base", type=Path, default=None)
    llamacpp.add_argument(ap)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--record", default=None)
    ap.add_argument("--flash-attn", default="off", choices=("off", "on", "auto"))
    args = ap.parse_args()

    import edgellm
    from edgellm.quality.perplexity import default_text, perplexity

    exe = llamacpp.tool("llama-perplexity", args.llama_bin)
    tmp = Path(tempfile.mkdtemp(prefix="pplcmp-"))
    text_file = tmp / "text.txt"
    text_file.write_text(default_text(), encoding="utf-8")
    common = ["-f", str(text_file), "-c", str(args.ctx), "-b", str(args.ctx), "--chunks", str(args.chunks),
              "-t", str(args.threads), "-fa", args.flash_attn]
    out = {"ctx": args.ctx, "chunks": args.chunks}
    if args.base:
        kl_file = tmp / "base.kld"
        llama(exe, ["-m", str(args.base), *common, "--kl-divergence-base", str(kl_file)])
        text, secs = llama(exe, ["-m", str(args.model), *common, "--kl-divergence-base", str(kl_file),
                                      "--kl-divergence"])
        out["llama"] = {
            "ppl": grab(r"Mean PPL\(Q\)\s*:\s*([\d.]+)", text)[0],
            "ppl_base": grab(r"Mean PPL\(base\)\s*:\s*([\d.]+)", text)[0],
            "ppl_ratio": grab(r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)", text)[0],
            "kl_mean": grab(r"Mean    KLD:\s*([-\d.]+)", text)[0],
            "kl_median": grab(r"Median  KLD:\s*([-\d.]+)", text)[0],
            "kl_p99": grab(r"99\.0%   KLD:\s*([-\d.]+)", text)[0],
            "kl_max": grab(r"Maximum KLD:\s*([-\d.]+)", text)[0],
            "same_top": grab(r"Same top p:\s*([\d.]+)", text)[0] / 100,
            "seconds": secs,
        }
    else:
        text, secs = llama(exe, ["-m", str(args.model), *common])
        ppl, err = grab(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)", text)
        out["llama"] = {"ppl": ppl, "ppl_err": err, "seconds": secs}

    t0 = time.perf_counter()
    fa = args.flash_attn
    m = edgellm.load(args.model, n_ctx=args.ctx, n_batch=args.ctx, threads=args.threads, flash_attn=fa)
    base = (edgellm.load(args.base, n_ctx=args.ctx, n_batch=args.ctx, threads=args.threads, flash_attn=fa)
            if args.base else None)
    r = perplexity(m, n_ctx=args.ctx, n_chunks=args.chunks, base=base)
    mine = {"ppl": r.ppl, "ppl_err": r.ppl_err, "seconds": time.perf_counter() - t0, "tokens_per_s": r.tokens_per_s}
    if r.kl:
        mine.update(ppl_base=r.kl.ppl_base, ppl_ratio=r.kl.ppl_ratio, kl_mean=r.kl.mean, kl_median=r.kl.median,
                    kl_p99=r.kl.p99, kl_max=r.kl.max, same_top=r.kl.same_top)
    out["edgellm"] = mine
    print(json.dumps(out, indent=1))
    if args.record:
        data = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
        data[args.record] = dict(out["llama"], ctx=args.ctx, chunks=args.chunks, model=args.model.name,
                                 flash_attn=args.flash_attn,
                                 base=args.base.name if args.base else None)
        data[args.record].pop("seconds", None)
        FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
