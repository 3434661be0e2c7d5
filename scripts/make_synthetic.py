#!/usr/bin/env python
"""Write a synthetic GGUF file (random weights, real llama.cpp layout) with edgellm.synthetic.

    python scripts/make_synthetic.py tiny.gguf --arch qwen3 --layers 4 --embd 256 --heads 4 --kv-heads 2
    python scripts/make_synthetic.py llama2-7b.gguf --preset llama2-7b --type F16 --sparse   # header only
"""
from __future__ import annotations

import argparse
import sys
import time

# Published shapes: n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, tied output
PRESETS = {
    "llama2-7b": dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000,
                      tied_output=False, n_ctx_train=4096),
    "llama2-13b": dict(arch="llama", n_layer=40, n_embd=5120, n_head=40, n_head_kv=40, n_ff=13824, n_vocab=32000,
                       tied_output=False, n_ctx_train=4096),
    "smollm2-135m": dict(arch="llama", n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_vocab=49152,
                         n_ctx_train=8192),
    "tiny": dict(arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512),
}


def main(argv: list[str] | None = None) -> int:
    from gguf import GGMLQuantizationType as GGMLType

    from edgellm.synthetic import ARCHITECTURES, write_synthetic_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="shape to start from (default tiny)")
    p.add_argument("--arch", choices=ARCHITECTURES)
    p.add_argument("--layers", type=int, dest="n_layer")
    p.add_argument("--embd", type=int, dest="n_embd")
    p.add_argument("--heads", type=int, dest="n_head")
    p.add_argument("--kv-heads", type=int, dest="n_head_kv")
    p.add_argument("--head-dim", type=int, dest="head_dim")
    p.add_argument("--ff", type=int, dest="n_ff")
    p.add_argument("--vocab", type=int, dest="n_vocab")
    p.add_argument("--ctx-train", type=int, dest="n_ctx_train")
    p.add_argument("--type", default="Q4_K", help="tensor type of the weight matrices (default Q4_K)")
    p.add_argument("--untied", action="store_true", help="write a separate output.weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sparse", action="store_true", help="header only; tensor data left as a hole")
    args = p.parse_args(argv)

    shape = dict(PRESETS[args.preset])
    for key in ("arch", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "n_ctx_train"):
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.untied:
        shape["tied_output"] = False
    try:
        ggml_type = GGMLType[args.type.upper()]
    except KeyError:
        p.error(f"unknown tensor type {args.type!r}")
    t0 = time.perf_counter()
    path = write_synthetic_gguf(args.path, ggml_type=ggml_type, seed=args.seed, sparse=args.sparse, **shape)
    print(f"wrote {path} in {time.perf_counter() - t0:.2f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
