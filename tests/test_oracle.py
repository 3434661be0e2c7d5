"""edgellm against llama.cpp: fixtures written by scripts/fixtures/make_oracle.py with llama-cpp-python on the
same files (the real models, and synthetic files of every architecture and type rebuilt here from the
same seed). Measures: token ids identical, teacher-forced top-1 agreement, KL(llama.cpp || edgellm),
greedy continuations identical."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import edgellm

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "fixtures"))
import make_oracle  # the fixture writer: prompts, shapes and seeds live there


def load_fixture(name):
    meta = json.loads((DATA / f"oracle_{name}.json").read_text())
    z = np.load(DATA / f"oracle_{name}.npz")
    keys = ("tokens", "top_ids", "top_logits", "lse", "greedy")
    return meta, [{k: z[f"{i}_{k}"] for k in keys} for i in range(meta["n_records"])]


def sha256(path) -> str:
    h = hashlib.sha256()
    h.update(Path(path).read_bytes())
    return h.hexdigest()


def compare(logits: np.ndarray, rec: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per position: (llama.cpp's top-1 == ours, KL(llama.cpp || edgellm) over its top-K + the rest)."""
    ours = logits.astype(np.float64)
    log_q = ours - np.logaddexp.reduce(ours, axis=1, keepdims=True)
    log_p = rec["top_logits"].astype(np.float64) - rec["lse"][:, None]
    p = np.exp(log_p)
    q_top = np.take_along_axis(log_q, rec["top_ids"].astype(np.int64), axis=1)
    kl = (p * (log_p - q_top)).sum(1)
    p_rest = np.clip(1 - p.sum(1), 1e-12, 1)
    q_rest = np.clip(1 - np.exp(q_top).sum(1), 1e-12, 1)
    kl += p_rest * np.log(p_rest / q_rest)
    top1 = rec["top_ids"][:, 0] == logits.argmax(1)
    return top1, kl


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b",
                                  pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.slow)])
def test_real_model_matches_llamacpp(name):
    from edgellm.fetch import model_path

    meta, records = load_fixture(name)
    path = model_path(name)
    assert meta["sha256"] == sha256(path), "the cached model file is not the one the fixtures were made from"
    model = edgellm.load(path, n_ctx=512, n_batch=512)
    top1, kls, greedy_same, max_diff = [], [], 0, 0.0
    for prompt, rec in zip(meta["prompts"], records):
        assert model.tokenize(prompt, add_special=True, parse_special=True) == rec["tokens"].tolist()
        logits = model.logits(rec["tokens"])
        ours_top = np.take_along_axis(logits, rec["top_ids"].astype(np.int64), axis=1)
        max_diff = max(max_diff, float(np.abs(ours_top - rec["top_logits"]).max()))
        a, k = compare(logits, rec)
        top1.append(a)
        kls.append(k)
        n = len(rec["greedy"])
        # a fresh context's evaluation (logits() above left the prompt's blocks in the cache)
        out = [c.token for c in model.generate(rec["tokens"].tolist(), max_tokens=n, temperature=0, ignore_eos=True,
                                               cache_prompt=False)]
        greedy_same += out == rec["greedy"].tolist()
    top1, kls = np.concatenate(top1), np.concatenate(kls)
    print(f"{name}: top-1 {top1.mean():.4f}, mean KL {kls.mean():.5f}, max KL {kls.max():.4f}, "
          f"greedy identical {greedy_same}/{len(records)}, max |logit diff| {max_diff:.2e}")
    # Every product, attention sum, exp and rounding follows ggml's x86 code (kernels/cpu/ir/,
    # the tiled K-quant prompt order in kquants.py): both files come out bit for bit.
    assert max_diff == 0.0
    assert greedy_same == len(records)
    assert top1.mean() >= 0.99
    assert kls.mean() <= 0.01
    assert greedy_same >= 4


@pytest.mark.parametrize("arch, tname", make_oracle.SYNTHETIC)
def test_synthetic_matches_llamacpp(tmp_path, arch, tname):
    from gguf import GGMLQuantizationType as T

    from edgellm.synthetic import write_synthetic_gguf

    meta, (rec,) = load_fixture(f"synthetic_{arch}_{tname}")
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch=arch, ggml_type=T[tname], **make_oracle.SYNTHETIC_SHAPE)
    assert sha256(path) == meta["sha256"], "synthetic writer output changed: rerun scripts/fixtures/make_oracle.py"
    model = edgellm.load(path, n_ctx=64, n_batch=64)
    top1, kl = compare(model.logits(rec["tokens"]), rec)
    # random weights give flat, near-tied distributions: top-1 must agree wherever llama.cpp's
    # first choice leads its second by more than the 8-bit activation noise (0.05 in logits)
    decisive = rec["top_logits"][:, 0] - rec["top_logits"][:, 1] > 0.05
    assert decisive.sum() >= len(top1) // 2
    assert top1[decisive].all(), (top1.mean(), kl.max())
    assert kl.mean() <= 0.01 and kl.max() <= 0.05, (kl.mean(), kl.max())


@pytest.mark.parametrize("arch, tname, changes", make_oracle.SYNTHETIC_EXACT)
def test_new_architecture_gives_llamacpps_logits_bit_for_bit(tmp_path, arch, tname, changes):
    """A synthetic file of each architecture added since (and a llama 3 file with rope_freqs):
    llama.cpp's prompt logits exactly, and its greedy continuation from a fresh context."""
    from gguf import GGMLQuantizationType as T

    from edgellm.synthetic import write_synthetic_gguf

    meta, (rec,) = load_fixture(make_oracle.exact_name(arch, tname, changes))
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch=arch, ggml_type=T[tname],
                                **{**make_oracle.SYNTHETIC_SHAPE, **changes})
    assert sha256(path) == meta["sha256"], "synthetic writer output changed: rerun scripts/fixtures/make_oracle.py"
    with edgellm.load(path, n_ctx=make_oracle.N_CTX, n_batch=make_oracle.N_CTX) as model:
        tokens = rec["tokens"].tolist()
        ours = np.take_along_axis(model.logits(tokens), rec["top_ids"].astype(np.int64), axis=1)
        assert float(np.abs(ours - rec["top_logits"]).max()) == 0.0
        greedy = [c.token for c in model.generate(tokens, max_tokens=len(rec["greedy"]), temperature=0,
                                                  ignore_eos=True, cache_prompt=False)]
        assert greedy == rec["greedy"].tolist()


def test_moe_expert_rows_in_the_wrong_order_miss_llamacpps_logits(tmp_path, monkeypatch):
    """The qwen3moe Q4_K fixture's Q6_K down experts get 8+ rows of the prompt: run them row by row
    (the one-token order) instead of together (llama.cpp's tiled order) and the prompt logits move,
    so the oracle test above sees the order."""
    from edgellm.models import qwen3moe
    from gguf import GGMLQuantizationType as T

    from edgellm.synthetic import write_synthetic_gguf

    arch, tname, changes = next(e for e in make_oracle.SYNTHETIC_EXACT if e[:2] == ("qwen3moe", "Q4_K"))
    _, (rec,) = load_fixture(make_oracle.exact_name(arch, tname, changes))
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch=arch, ggml_type=T[tname],
                                **{**make_oracle.SYNTHETIC_SHAPE, **changes})
    monkeypatch.setattr(qwen3moe, "_GROUPED", set())
    with edgellm.load(path, n_ctx=make_oracle.N_CTX, n_batch=make_oracle.N_CTX) as model:
        ours = np.take_along_axis(model.logits(rec["tokens"].tolist()), rec["top_ids"].astype(np.int64), axis=1)
    assert float(np.abs(ours - rec["top_logits"]).max()) > 0.0
