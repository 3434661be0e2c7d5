"""edgellm with flash_attn="on" against llama.cpp with flash attention on (its tools' CPU default):
fixtures written by scripts/fixtures/make_fa_oracle.py with llama-cpp-python (f16 cache, a fresh
context per prompt, 2 threads). Bit for bit: every recorded logit of every prompt position (one-chunk
kernel for a short prompt, tiled for 64+ tokens) and of 32 one-token decode steps (one-chunk below
257 cached tokens, split-KV into 2 cell ranges above: of a 512-cell view, and past 512 tokens of a
768-cell one, where Gemma-3's sliding window masks), and the greedy tokens."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import edgellm

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "fixtures"))
import make_fa_oracle  # noqa: E402  (the fixture writer: prompts and settings live there)
from make_oracle import sha256  # noqa: E402


def load_fixture(name):
    meta = json.loads((DATA / f"oracle_fa_{name}.json").read_text())
    z = np.load(DATA / f"oracle_fa_{name}.npz")
    keys = ("tokens", "top_ids", "top_logits", "greedy", "step_ids", "step_logits")
    return meta, [{k: z[f"{i}_{k}"] for k in keys} for i in range(meta["n_records"])]


def run_fixture(name, flash_attn="on"):
    """(max |logit diff| over prompts, over decode steps, greedy tokens identical per record)."""
    from edgellm.fetch import model_path

    meta, records = load_fixture(name)
    path = model_path(name)
    assert meta["sha256"] == sha256(path), "the cached model file is not the one the fixtures were made from"
    assert meta["n_threads"] == make_fa_oracle.N_THREADS
    model = edgellm.load(path, n_ctx=meta["n_ctx"], n_batch=meta["n_batch"], threads=meta["n_threads"],
                         flash_attn=flash_attn)
    d_prompt, d_step, same = 0.0, 0.0, []
    for (text, cap), rec in zip(meta["prompts"], records):
        assert model.tokenize(text, add_special=True, parse_special=True)[:cap] == rec["tokens"].tolist()
        logits = model.logits(rec["tokens"])  # a fresh context, the prompt in one batch
        ours = np.take_along_axis(logits, rec["top_ids"].astype(np.int64), axis=1)
        d_prompt = max(d_prompt, float(np.abs(ours - rec["top_logits"]).max()))
        nxt, got = int(logits[-1].argmax()), []
        for i in range(len(rec["greedy"])):
            got.append(nxt)
            row = model.eval([nxt])  # one-token decode steps on the prompt's context
            d_step = max(d_step, float(np.abs(row[rec["step_ids"][i]] - rec["step_logits"][i]).max()))
            nxt = int(row.argmax())
        same.append(got == rec["greedy"].tolist())
    return d_prompt, d_step, same


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_flash_attn_matches_llamacpp_flash_attn(name):
    if not (DATA / f"oracle_fa_{name}.json").exists():
        pytest.skip(f"no flash-attention fixture for {name} (scripts/fixtures/make_fa_oracle.py)")
    d_prompt, d_step, same = run_fixture(name)
    print(f"{name}: max |logit diff| prompt {d_prompt:.2e}, decode {d_step:.2e}, greedy identical {same}")
    assert d_prompt == 0.0
    assert d_step == 0.0
    assert all(same)
