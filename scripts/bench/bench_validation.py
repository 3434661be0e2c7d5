"""CPU time of the checks a model's load runs (developer tool, never imported).

    python scripts/bench/bench_validation.py MODEL.gguf [MODEL.gguf ...] [--repeat 7]

Per file, the median CPU time (time.process_time) of: `ModelConfig.from_gguf` (typed getters,
hyperparameters against each other, every tensor's shape against them, the vocabulary's arrays
and ids), `check_tokenizer` alone (also run by `Tokenizer.from_metadata`), and the CPU backend's
checks of every weight matrix's bytes and every block's shapes against its activations
(`check_matrix_bytes`, `check_fused_block`: run once, at the first step). The file is opened once
(reading the header is not validation).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def median_cpu_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times) * 1000


def main(argv=None) -> int:
    from edgellm.kernels.cpu.backend import CPUBackend
    from edgellm.config import ModelConfig
    from edgellm.gguf_file import GGUFFile
    from edgellm.models.decoder import BIASES, OPTIONAL, REQUIRED
    from edgellm.validate import check_fused_block, check_matrix_bytes, check_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    print("| file | ModelConfig.from_gguf | check_tokenizer | weights + blocks (first step) | total |")
    print("|---|---|---|---|---|")
    for path in args.models:
        gf = GGUFFile(path)
        cfg = ModelConfig.from_gguf(gf)
        b = CPUBackend(1)
        blocks = []
        for il in range(cfg.n_layer):
            w = {n: b.weight(gf.tensor(f"blk.{il}.{n}.weight")) for n in REQUIRED}
            w.update({n: b.weight(gf.tensors[f"blk.{il}.{n}.weight"]) if f"blk.{il}.{n}.weight" in gf.tensors
                      else None for n in OPTIONAL})
            w.update({n + "_bias": b.weight(gf.tensors[f"blk.{il}.{n}.bias"]) if f"blk.{il}.{n}.bias" in gf.tensors
                      else None for n in BIASES})
            blocks.append(SimpleNamespace(**w))
        s = SimpleNamespace(**{k: np.empty((1, m), np.float32) for k, m in dict(
            h=cfg.n_embd, q=cfg.n_head * cfg.head_dim_k, k=cfg.n_head_kv * cfg.head_dim_k,
            v=cfg.n_head_kv * cfg.head_dim_v, a=cfg.n_head * cfg.head_dim_v, o=cfg.n_embd,
            gate=cfg.n_ff, up=cfg.n_ff).items()})
        x = np.empty((1, cfg.n_embd), np.float32)
        kc = np.empty((16, cfg.n_head_kv, cfg.head_dim_k), np.uint16)
        vc = np.empty((16, cfg.n_head_kv, cfg.head_dim_v), np.uint16)
        mats = [getattr(L, n) for L in blocks for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                         "ffn_up", "ffn_down")]

        def runtime_checks():
            for m in mats:
                check_matrix_bytes(m)
            for L in blocks:
                check_fused_block(L, x, s, kc, vc)

        a = median_cpu_ms(lambda: ModelConfig.from_gguf(gf), args.repeat)
        t = median_cpu_ms(lambda: check_tokenizer(gf.metadata, gf.path), args.repeat)
        r = median_cpu_ms(runtime_checks, args.repeat)
        print(f"| {Path(path).name} | {a:.2f} ms | {t:.2f} ms | {r:.2f} ms | {a + t + r:.2f} ms |")
        del blocks, mats
        gf.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
