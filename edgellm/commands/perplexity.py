"""`edgellm perplexity MODEL`: llama-perplexity's PPL (and, with --kl-base, its KL statistics)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="GGUF file or known model name")
    p.add_argument("--text", "-f", metavar="FILE", default=None,
                   help="UTF-8 text to score (default: Python's pydoc topics, ~465 K characters)")
    p.add_argument("-c", "--ctx", type=int, default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--chunks", type=int, default=None, metavar="N", help="score only the first N chunks")
    p.add_argument("-b", "--batch", type=int, default=512, metavar="N", help="prompt batch size")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    p.add_argument("--kl-base", metavar="BASE", default=None,
                   help="also run BASE (e.g. the F16 file) on the same chunks and report KL(BASE || MODEL)")
    p.add_argument("--json", action="store_true", help="print JSON")
    from edgellm.commands.flags import add_flash_attn_argument

    add_flash_attn_argument(p)


def run(args) -> int:
    import json
    import sys

    import edgellm
    from edgellm.errors import InvalidArgumentError
    from edgellm.quality.perplexity import perplexity, read_text

    if args.ctx < 4 or args.batch < 1:
        raise InvalidArgumentError("-c must be >= 4 and -b >= 1")
    text = read_text(args.text)
    model = edgellm.load(args.model, n_ctx=args.ctx, n_batch=args.batch, threads=args.threads, quiet=args.json,
                         flash_attn=args.flash_attn)
    base = None
    if args.kl_base:
        base = edgellm.load(args.kl_base, n_ctx=args.ctx, n_batch=args.batch, threads=args.threads, quiet=args.json,
                            flash_attn=args.flash_attn)

    def progress(i, n, ppl):
        if not args.json:
            print(f"[{i}]{ppl:.4f}", end="," if i < n else "\n", file=sys.stderr, flush=True)

    r = perplexity(model, text, n_ctx=args.ctx, n_chunks=args.chunks, base=base, progress=progress)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    print(f"{r.n_chunks} chunks of {r.n_ctx} tokens ({r.n_scored} scored) from {r.n_text_tokens} tokens of text, "
          f"{r.seconds:.1f} s ({r.tokens_per_s:.1f} tokens/s)")
    print(f"Final estimate: PPL = {r.ppl:.4f} +/- {r.ppl_err:.5f}")
    if r.kl is not None:
        k = r.kl
        print(f"PPL(base)              : {k.ppl_base:.4f}")
        print(f"PPL(Q)/PPL(base)       : {k.ppl_ratio:.6f} ± {k.ppl_ratio_err:.6f}")
        print(f"Mean    KLD: {k.mean:10.6f} ± {k.mean_err:10.6f}")
        print(f"Median  KLD: {k.median:10.6f}")
        print(f"99.0%   KLD: {k.p99:10.6f}")
        print(f"Maximum KLD: {k.max:10.6f}")
        print(f"RMS Δp     : {100 * k.rms_p_diff:6.3f} %")
        print(f"Same top p : {100 * k.same_top:6.3f} ± {100 * k.same_top_err:5.3f} %")
    return 0
