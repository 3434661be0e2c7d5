#!/usr/bin/env python
"""Make the 1B-8B benchmark files and compare edgellm with llama.cpp on them (dev only).

The published shapes of four models people run, random weights written as F16 by
edgellm.synthetic, then quantized by llama.cpp's `llama-quantize` into each type; finally
scripts/bench_vs_llamacpp.py over every file (with --llama-bench: llama.cpp's own llama-bench).

    python scripts/make_bench_models.py --llama-bin DIR [--models llama-1b,qwen-1.5b] \
        [--types Q4_K_M,Q4_0] [--bench] [-p 512 -n 128 -r 3 -t 2] [--out DIR]

Files go to <user cache>/bench (EDGELLM_CACHE etc., see edgellm.fetch.cache_dir) unless --out;
an existing file is kept. The F16 file of the 8B shape is 16 GB and needs that much RAM to write.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

# n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, tied output (from the models' config.json)
SHAPES = {
    # Llama-3.2-1B ties its output to the embeddings; the benchmark file keeps a separate output
    # matrix (the heavier case, as llama.cpp's quantized files of untied models have)
    "llama-1b": {"arch": "llama", "n_layer": 16, "n_embd": 2048, "n_head": 32, "n_head_kv": 8, "n_ff": 8192,
                 "n_vocab": 128256, "tied_output": False},
    "qwen-1.5b": {"arch": "qwen2", "n_layer": 28, "n_embd": 1536, "n_head": 12, "n_head_kv": 2, "n_ff": 8960,
                  "n_vocab": 151936, "tied_output": True},
    "llama-3b": {"arch": "llama", "n_layer": 28, "n_embd": 3072, "n_head": 24, "n_head_kv": 8, "n_ff": 8192,
                 "n_vocab": 128256, "tied_output": True},
    "llama-8b": {"arch": "llama", "n_layer": 32, "n_embd": 4096, "n_head": 32, "n_head_kv": 8, "n_ff": 14336,
                 "n_vocab": 128256, "tied_output": False},
}
TYPES = ("Q4_K_M", "Q4_0", "Q5_K_M", "Q6_K", "Q8_0", "Q3_K_M")


def make_f16(path: Path, shape: dict) -> None:
    from gguf import GGMLQuantizationType as GGMLType

    from edgellm.synthetic import write_synthetic_gguf

    t0 = time.perf_counter()
    tmp = path.with_suffix(".part")
    write_synthetic_gguf(tmp, ggml_type=GGMLType.F16, n_ctx_train=8192, seed=0, **shape)
    tmp.rename(path)
    print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def quantize(bin_dir: Path, src: Path, dst: Path, qtype: str, threads: int) -> None:
    t0 = time.perf_counter()
    env = dict(os.environ, LD_LIBRARY_PATH=str(bin_dir))
    tmp = dst.with_suffix(".part")
    r = subprocess.run([str(bin_dir / "llama-quantize"), str(src), str(tmp), qtype, str(threads)],
                       check=False, capture_output=True, text=True, env=env)
    if r.returncode:
        raise SystemExit(f"llama-quantize {qtype} failed:\n{r.stderr[-2000:]}")
    tmp.rename(dst)
    print(f"wrote {dst} ({dst.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    from edgellm.fetch import cache_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-quantize (and llama-bench)")
    ap.add_argument("--models", default="llama-1b", help=f"comma list of {', '.join(SHAPES)} (default llama-1b)")
    ap.add_argument("--types", default=",".join(TYPES), help="comma list of llama-quantize types")
    ap.add_argument("--out", type=Path, default=None, help="folder for the files (default <user cache>/bench)")
    ap.add_argument("--keep-f16", action="store_true", help="keep the F16 source files")
    ap.add_argument("--bench", action="store_true", help="run scripts/bench_vs_llamacpp.py on every file")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", type=int, default=2)
    args = ap.parse_args(argv)

    out = args.out or cache_dir() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name in args.models.split(","):
        if name not in SHAPES:
            ap.error(f"unknown model shape {name!r}; one of {', '.join(SHAPES)}")
        f16 = out / f"{name}-F16.gguf"
        targets = [(t, out / f"{name}-{t}.gguf") for t in args.types.split(",")]
        if any(not p.exists() for _, p in targets) and not f16.exists():
            make_f16(f16, SHAPES[name])
        for qtype, path in targets:
            if not path.exists():
                quantize(args.llama_bin, f16, path, qtype, args.t)
            files.append(path)
        if f16.exists() and not args.keep_f16:
            f16.unlink()
    if args.bench:
        script = Path(__file__).with_name("bench_vs_llamacpp.py")
        for path in files:
            subprocess.run([sys.executable, str(script), str(path), "-p", str(args.p), "-n", str(args.n),
                            "-r", str(args.r), "-t", str(args.t), "--llama-bench", str(args.llama_bin / "llama-bench")],
                           check=True)
    else:
        print("\n".join(map(str, files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
