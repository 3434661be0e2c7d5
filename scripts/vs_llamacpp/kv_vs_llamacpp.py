"""Dev tool: edgellm with a quantized KV cache against llama.cpp with the same cache type, token by token.

    python scripts/vs_llamacpp/kv_vs_llamacpp.py [--llama-bin DIR] MODEL.gguf [--kv-type q8_0] \
        [-c 128] [--chunks 8] [-t 2]

llama-perplexity runs the model with `-ctk/-ctv KV_TYPE -fa on` (llama.cpp needs flash attention for
a quantized V) over edgellm's default text and writes its log-probabilities with
`--kl-divergence-base` (per scored token: a float32 scale and offset, then one uint16 per vocabulary
entry; log p = scale * q + offset). edgellm then evaluates the same token ids (read back from that
file, so tokenization plays no part) with `kv_type=KV_TYPE`, and this prints, over the scored
positions (the second half of each chunk, as llama-perplexity scores them), the mean KL(llama.cpp ||
edgellm) with its standard error (log-probs below -16 left out, as llama-perplexity does), the 99th percentile and maximum, and how often the two top tokens
agree. The same is printed for edgellm's f16 cache against llama.cpp's quantized one, for scale.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama-perplexity)


def read_llama_base(path: Path):
    """(n_ctx, tokens (n_chunk, n_ctx) int32, [per chunk: log-probs float64 (n_scored, n_vocab)])."""
    raw = path.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit(f"{path}: not a llama-perplexity --kl-divergence-base file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    at = 20
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, at).reshape(n_chunk, n_ctx)
    at += tokens.nbytes
    nv = 2 * ((n_vocab + 1) // 2) + 4
    n_scored = n_ctx - 1 - n_ctx // 2
    chunks = []
    for _ in range(n_chunk):
        rows = np.frombuffer(raw, np.uint16, n_scored * nv, at).reshape(n_scored, nv)
        at += rows.nbytes
        head = np.ascontiguousarray(rows[:, :4]).view(np.float32)  # scale, min log-prob
        q = rows[:, 4:4 + n_vocab].astype(np.float32)
        chunks.append((head[:, 0:1] * q + head[:, 1:2]).astype(np.float64))
    return int(n_ctx), tokens, chunks


def compare(base_lp: list[np.ndarray], ours: list[np.ndarray]) -> dict:
    kls, same = [], []
    for lp_b, logits in zip(base_lp, ours):
        z = logits.astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        keep = lp_b > -16.0  # as llama-perplexity: the stored tail (clamped at max - 16) is left out
        kls.append(np.where(keep, np.exp(lp_b) * (lp_b - lp), 0.0).sum(axis=1))
        same.append(lp_b.argmax(axis=1) == lp.argmax(axis=1))
    kl, same = np.concatenate(kls), np.concatenate(same)
    return {"kl_mean": float(kl.mean()), "kl_mean_err": float(kl.std(ddof=1) / np.sqrt(len(kl))),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()), "same_top": float(same.mean()),
            "positions": int(len(kl))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    llamacpp.add_argument(ap)
    ap.add_argument("--kv-type", default="q8_0")
    ap.add_argument("-c", "--ctx", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-fa", "--flash-attn", default="on", choices=("on", "off"),
                    help="llama.cpp's flash attention (on: needed for a quantized V; off: a check that "
                         "f16 against f16 gives KL ~0)")
    args = ap.parse_args()

    import edgellm
    from edgellm.quality.perplexity import default_text, scored_logits

    tmp = Path(tempfile.mkdtemp(prefix="kvcmp-"))
    text_file = tmp / "text.txt"
    text_file.write_text(default_text(), encoding="utf-8")
    kld = tmp / "llama.kld"
    exe = llamacpp.tool("llama-perplexity", args.llama_bin)
    cmd = [str(exe), "-m", str(args.model), "-f", str(text_file), "-c", str(args.ctx),
           "-b", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads), "-fa", args.flash_attn,
           "-ctk", args.kv_type, "-ctv", args.kv_type, "--kl-divergence-base", str(kld)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=llamacpp.env_for(exe))
    if p.returncode != 0:
        raise SystemExit(p.stderr[-2000:])
    n_ctx, tokens, base_lp = read_llama_base(kld)
    out = {"model": args.model.name, "kv_type": args.kv_type, "flash_attn": args.flash_attn, "ctx": n_ctx,
           "chunks": len(base_lp)}
    for kv in dict.fromkeys((args.kv_type, "f16")):
        m = edgellm.load(args.model, n_ctx=n_ctx, n_batch=n_ctx, threads=args.threads, kv_type=kv, quiet=True)
        chunks = tokens.copy()
        if m.tokenizer.add_bos:  # llama-perplexity puts BOS first in each chunk after writing the ids
            chunks[:, 0] = m.tokenizer.bos_id
        ours = [scored_logits(m, chunk) for chunk in chunks]
        out[f"edgellm {kv} vs llama.cpp {args.kv_type}"] = compare(base_lp, ours)
        del m
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
