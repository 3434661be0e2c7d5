"""`edgellm quantize IN.gguf OUT.gguf TYPE`: llama-quantize's types, recipes and output, in Python."""
from __future__ import annotations

import argparse

TYPES_HELP = ("F32, F16, BF16, Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q5_1, Q5_0, Q4_K_M, Q4_K_S, Q4_1, Q4_0, Q3_K_L, "
              "Q3_K_M, Q3_K_S, Q2_K")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", metavar="IN", help="source .gguf file (F32/F16/BF16; quantized with --allow-requantize)")
    p.add_argument("output", metavar="OUT", help="file to write")
    p.add_argument("type", metavar="TYPE", help=TYPES_HELP)
    p.add_argument("--pure", action="store_true", help="every quantizable tensor in TYPE's base type (no mix)")
    p.add_argument("--allow-requantize", action="store_true", help="accept an already quantized input")
    p.add_argument("--leave-output-tensor", action="store_true", help="keep output.weight as it is")
    p.add_argument("--output-type", metavar="T", default=None, help="type of output.weight (e.g. Q8_0, F16)")
    p.add_argument("--token-embedding-type", metavar="T", default=None, help="type of token_embd.weight")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="worker threads")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-tensor progress")


def run(args) -> int:
    import sys

    import edgellm
    from edgellm.memory import format_size

    def progress(i, n, r):
        if not args.quiet:
            shape = "x".join(str(d) for d in r.shape)
            change = f"{r.src_type:>5} -> {r.dst_type:<5}" if r.src_type != r.dst_type else f"{r.src_type:>5} (copied)"
            print(f"[{i:4d}/{n:4d}] {r.name:<36s} {shape:>14s}  {change}  {format_size(r.src_bytes):>10s} -> "
                  f"{format_size(r.dst_bytes):>10s}", file=sys.stderr, flush=True)

    res = edgellm.quantize(args.input, args.output, args.type, pure=args.pure,
                           allow_requantize=args.allow_requantize, leave_output_tensor=args.leave_output_tensor,
                           output_type=args.output_type, token_embedding_type=args.token_embedding_type,
                           threads=args.threads, progress=progress)
    for name, wanted, used in res.fallbacks:
        print(f"fallback: {name}: rows do not split into {wanted.name} blocks -> {used.name}", file=sys.stderr)
    print(f"{res.path}: {res.file_type}, {format_size(res.src_bytes)} -> {format_size(res.dst_bytes)} "
          f"({res.bits_per_weight:.2f} bits/weight), {res.seconds:.1f} s", file=sys.stderr)
    return 0
