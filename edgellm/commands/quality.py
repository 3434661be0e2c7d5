"""`edgellm quality BASE.gguf`: quantize to several types and put size, quality and speed side by side."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", metavar="BASE", help="the reference GGUF file (F16/BF16/F32 ideally)")
    p.add_argument("--types", default=None, metavar="LIST",
                   help="comma-separated types (default Q8_0,Q6_K,Q5_K_M,Q4_K_M,Q4_0,Q3_K_M,Q2_K)")
    p.add_argument("--text", "-f", metavar="FILE", default=None, help="text to score (default: pydoc topics)")
    p.add_argument("--chunks", type=int, default=4, metavar="N", help="chunks scored per type (default 4)")
    p.add_argument("-c", "--ctx", type=int, default=512, metavar="N", help="tokens per chunk (default 512)")
    p.add_argument("--max-kl", type=float, default=0.01, metavar="KL", help="KL budget for the knee (0.01)")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    p.add_argument("--allow-requantize", action="store_true", help="accept a quantized BASE")
    p.add_argument("--plot", metavar="PNG", default=None, help="also draw size against KL (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--no-save", action="store_true",
                   help="do not keep the report (by default it goes to the user cache, where `plan` reads it)")


def run(args) -> int:
    import json
    import sys

    from edgellm.quality import report
    from edgellm.quality.perplexity import read_text

    if args.plot:  # fail before minutes of work, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            report.plot(None, args.plot)
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else report.DEFAULT_TYPES
    text = read_text(args.text) if args.text else None
    say = None if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    rep = report.quality(args.base, types, text=text, n_ctx=args.ctx, n_chunks=args.chunks, threads=args.threads,
                         max_kl=args.max_kl, allow_requantize=args.allow_requantize, progress=say)
    if args.plot:
        report.plot(rep, args.plot)
    if not args.no_save:
        from edgellm.gguf_file import GGUFFile
        from edgellm.quality import store

        gf = GGUFFile(args.base)
        path = store.save(rep, store.model_key(gf))
        gf.close()
        print(f"report kept in {path} (`edgellm plan` on this model or any of its quant types reads it)",
              file=sys.stderr)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
        return 0
    print(report.table(rep))
    print()
    print(report.chart(rep))
    if args.plot:
        print(f"chart written to {args.plot}")
    return 0
