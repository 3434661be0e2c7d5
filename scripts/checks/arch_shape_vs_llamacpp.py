"""Dev check (needs llama-cpp-python): a synthetic file of an architecture at a real model's width
(fewer layers) against llama.cpp: max |logit diff| over the prompt and greedy tokens equal.

    python scripts/checks/arch_shape_vs_llamacpp.py smollm3 --types Q8_0,Q4_K
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import make_oracle  # noqa: E402

# real models' widths: (n_embd, n_head, n_head_kv, n_ff); the layer count is an argument
SHAPES = {"smollm3": (2048, 16, 4, 11008),  # SmolLM3-3B
          "granite": (2048, 32, 8, 8192),  # Granite-3.3-2B
          "olmo2": (2048, 16, 16, 8192),  # OLMo-2-0425-1B
          "phi3": (3072, 32, 32, 8192),  # Phi-3.5-mini (head 96, LongRoPE long factors)
          "gemma2": (2304, 8, 4, 9216)}  # Gemma-2-2B (head 256; window 4096 > the prompt: 16 here)
UNTIED = {"olmo2", "phi3"}  # llama.cpp loads these only with an output head of their own
# the arch's own file contents: phi3's LongRoPE (long: 512 > 256) factors, a name without "phi3"
EXTRA = {"gemma2": dict(head_dim=256, sliding_window=16),
         "phi3": dict(name="synthetic-longrope", hparams={"rope.scaling.original_context_length": 256,
                                                           "rope.scaling.attn_factor": 1.1902380714238083},
                      f32_tensors={"rope_factors_long.weight": [1 + i * 0.5 for i in range(48)],
                                   "rope_factors_short.weight": [1 + i / 96 for i in range(48)]})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arch", choices=sorted(SHAPES))
    ap.add_argument("--types", default="Q8_0,Q4_K")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--greedy", type=int, default=32)
    args = ap.parse_args()
    from gguf import GGMLQuantizationType as T

    import edgellm
    from edgellm.synthetic import write_synthetic_gguf

    n_embd, n_head, n_kv, n_ff = SHAPES[args.arch]
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for tname in args.types.split(","):
            path = write_synthetic_gguf(Path(tmp) / f"{tname}.gguf", arch=args.arch, ggml_type=T[tname],
                                        n_layer=args.layers, n_embd=n_embd, n_head=n_head, n_head_kv=n_kv,
                                        n_ff=n_ff, n_vocab=4096, seed=5, tied_output=args.arch not in UNTIED,
                                        **EXTRA.get(args.arch, {}))
            rec = make_oracle.reference(path, make_oracle.SYNTHETIC_TOKENS, None, args.greedy)
            with edgellm.load(path, n_ctx=make_oracle.N_CTX, n_batch=make_oracle.N_CTX) as m:
                tokens = rec["tokens"].tolist()
                ours = np.take_along_axis(m.logits(tokens), rec["top_ids"].astype(np.int64), axis=1)
                diff = float(np.abs(ours - rec["top_logits"]).max())
                greedy = [c.token for c in m.generate(tokens, max_tokens=args.greedy, temperature=0,
                                                      ignore_eos=True, cache_prompt=False)]
            same = greedy == rec["greedy"].tolist()
            print(f"{args.arch} {tname} {args.layers}x{n_embd}: max |logit diff| {diff:g}, greedy "
                  f"{'equal' if same else 'DIFFERENT'} ({len(greedy)} tokens)")
            worst = max(worst, diff if same else float("inf"))
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
