"""Write llama.cpp reference fixtures into tests/data (dev only: needs llama-cpp-python, never a
dependency of edgellm).

For the two real models and for small synthetic files of every architecture and tensor type (written
by edgellm.synthetic with a fixed seed, so CI can rebuild the identical file and check its sha256):
  - the prompt's token ids (llama_tokenize with add_special and parse_special),
  - per position the top-K logits (ids, values) and the log-sum-exp of the full row, enough to compute
    teacher-forced top-1 agreement and KL(llama.cpp || edgellm) over the top-K mass,
  - a greedy continuation of N_GREEDY tokens.

    python scripts/make_oracle.py            # all fixtures
    python scripts/make_oracle.py --only real
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"
TOP_K = 64
N_GREEDY = 24
N_CTX = 512

# longer than two FFN chunks (models/decoder.py), so a prompt's FFN runs in three pieces
LONG_PROMPT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him: one hundred and twelve, no more and no less. At the top he trimmed the wick, "
    "polished the great lens with a soft cloth, and checked the level of oil in the reservoir. Ships "
    "passing the headland relied on the beam to find the narrow channel between the reef and the cliffs, "
    "and in forty years the light had never failed. In winter the storms came in from the west, driving "
    "spray against the glass so hard that the whole tower seemed to shudder. On those nights he did not "
    "sleep at all; he sat by the lamp with a pot of tea, a logbook open on his knees, writing down the "
    "wind, the swell, and the names of the vessels that signalled as they went by. When the supply boat "
    "arrived each month, the young sailors asked him whether he was lonely out there. He always gave the "
    "same answer: a man who keeps a light is never alone, because somewhere in the dark there is always "
    "someone watching for it. Years later, when the light was automated and the keeper moved to the "
    "village, he still walked to the harbour wall every evening to see the beam sweep across the water, "
    "and he still counted, under his breath, the seconds between the flashes."
)

QWEN_PROMPTS = [
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWrite a Python function that checks whether a string is a palindrome.<|im_end|>\n"
    "<|im_start|>assistant\n",
    "def quicksort(arr):\n    if len(arr) <= 1:\n        return arr\n",
    "// Return the n-th Fibonacci number.\nfn fib(n: u64) -> u64 {\n",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
    "The capital of France is",
    LONG_PROMPT,
]

REAL_PROMPTS = {
    "smollm2-135m": [
        "The capital of France is",
        "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "In 1969, Neil Armstrong became the first person to",
        "Photosynthesis is the process by which plants",
        LONG_PROMPT,
    ],
    "gemma3-270m": [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Water boils at 100 degrees Celsius because",
        "The three primary colors are",
        LONG_PROMPT,
    ],
    "qwen2.5-coder-0.5b": QWEN_PROMPTS,
    "qwen2.5-coder-1.5b": QWEN_PROMPTS,
}
# greedy tokens per real model (issue: 32 for the Qwen files)
N_GREEDY_REAL = {"qwen2.5-coder-0.5b": 32, "qwen2.5-coder-1.5b": 32}

# synthetic files: (arch, ggml type name); shapes chosen so every row splits into 256-blocks
SYNTHETIC_SHAPE = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=384, seed=11)
SYNTHETIC = [
    ("llama", "F32"), ("llama", "F16"), ("llama", "BF16"), ("llama", "Q4_0"), ("llama", "Q4_1"),
    ("llama", "Q5_0"), ("llama", "Q5_1"), ("llama", "Q8_0"), ("llama", "Q2_K"), ("llama", "Q3_K"),
    ("llama", "Q4_K"), ("llama", "Q5_K"), ("llama", "Q6_K"),
    ("qwen2", "Q8_0"), ("qwen2", "Q4_K"), ("qwen3", "Q8_0"), ("qwen3", "Q6_K"), ("gemma3", "Q8_0"),
    ("gemma3", "Q5_K"),
]
SYNTHETIC_TOKENS = [1, 45, 120, 7, 300, 31, 200, 99, 5, 64, 128, 250, 17, 3, 333, 80, 42, 150, 260, 11,
                    77, 190, 12, 301]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def reference(path: Path, tokens: list[int] | None, prompt: str | None, n_greedy: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, n_threads=2, logits_all=True, verbose=False,
                seed=0)
    if tokens is None:
        tokens = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(tokens)
    scores = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    top = np.argsort(-scores, axis=1, kind="stable")[:, :TOP_K]
    lse = np.logaddexp.reduce(scores.astype(np.float64), axis=1)
    greedy = []
    nxt = int(scores[-1].argmax())
    for _ in range(n_greedy):
        greedy.append(nxt)
        if llm.n_tokens >= N_CTX:
            break
        llm.eval([nxt])
        nxt = int(np.array(llm.scores[llm.n_tokens - 1]).argmax())
    return {
        "tokens": np.array(tokens, dtype=np.int32),
        "top_ids": top.astype(np.int32),
        "top_logits": np.take_along_axis(scores, top, axis=1),
        "lse": lse,
        "greedy": np.array(greedy, dtype=np.int32),
    }


def save(name: str, records: list[dict], meta: dict) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    arrays = {}
    for i, r in enumerate(records):
        for k, v in r.items():
            arrays[f"{i}_{k}"] = v
    out = DATA / f"oracle_{name}.npz"
    np.savez_compressed(out, **arrays)
    (DATA / f"oracle_{name}.json").write_text(json.dumps({**meta, "n_records": len(records)}, indent=1) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


def make_real(models: list[str] | None = None) -> None:
    import llama_cpp

    from edgellm.fetch import model_path

    for name, prompts in REAL_PROMPTS.items():
        if models and name not in models:
            continue
        path = model_path(name)
        records = [reference(path, None, p, N_GREEDY_REAL.get(name, N_GREEDY)) for p in prompts]
        save(name, records, {"model": name, "sha256": sha256(path), "prompts": prompts, "top_k": TOP_K,
                             "llama_cpp_python": llama_cpp.__version__})


def make_synthetic() -> None:
    import llama_cpp
    from gguf import GGMLQuantizationType as T

    from edgellm.synthetic import write_synthetic_gguf

    with tempfile.TemporaryDirectory() as tmp:
        for arch, tname in SYNTHETIC:
            path = write_synthetic_gguf(Path(tmp) / f"{arch}-{tname}.gguf", arch=arch, ggml_type=T[tname],
                                        **SYNTHETIC_SHAPE)
            rec = reference(path, SYNTHETIC_TOKENS, None, 8)
            save(f"synthetic_{arch}_{tname}", [rec],
                 {"arch": arch, "type": tname, "shape": SYNTHETIC_SHAPE, "sha256": sha256(path), "top_k": TOP_K,
                  "llama_cpp_python": llama_cpp.__version__})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("real", "synthetic"))
    ap.add_argument("--models", help="comma-separated known model names (real fixtures only for these)")
    args = ap.parse_args()
    if args.only in (None, "real"):
        make_real(args.models.split(",") if args.models else None)
    if args.only in (None, "synthetic"):
        make_synthetic()
    return 0


if __name__ == "__main__":
    sys.exit(main())
