"""Perplexity and KL arithmetic (llama-perplexity's), chunking, and the real SmolLM2 at -c 128."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgellm.errors import InvalidArgumentError
from edgellm.quality import perplexity as px


def log_softmax64(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


@pytest.fixture
def logits():
    rng = np.random.default_rng(0)
    return (3 * rng.standard_normal((40, 1000))).astype(np.float32), rng.integers(0, 1000, 40)


def test_default_text_is_pydoc_topics():
    text = px.default_text()
    assert len(text) > 400_000 and text.startswith("The \"assert\" statement\n")


def test_make_chunks():
    toks = list(range(1, 1001))
    c = px.make_chunks(toks, 128, None, bos=0)
    assert c.shape == (7, 128) and (c[:, 0] == 0).all() and c[1, 1] == 130  # BOS replaces, never shifts
    assert px.make_chunks(toks, 128, 2, bos=None)[1, 0] == 129
    with pytest.raises(InvalidArgumentError, match="at least 2048"):
        px.make_chunks(toks, 1024, None, bos=0)


def test_nll_rows(logits):
    lg, tgt = logits
    want = -log_softmax64(lg)[np.arange(len(tgt)), tgt]
    np.testing.assert_allclose(px.nll_rows(lg, tgt), want, rtol=0, atol=2e-5)


def test_base_log_probs_16_bit_steps(logits):
    lg, _ = logits
    b = px.BaseLogProbs.from_logits(lg)
    lp = log_softmax64(lg)
    back = b.scale[:, None].astype(np.float64) * b.q + b.min_log_prob[:, None]
    high = lp > lp.max(axis=1, keepdims=True) - 16
    assert np.abs(back - lp)[high].max() <= 1.01 * b.scale.max() / 2 + 1e-5  # half a step
    assert (b.q.max(axis=1) == 65535).all()


def test_kl_rows(logits):
    lg, tgt = logits
    rng = np.random.default_rng(1)
    other = lg + (0.3 * rng.standard_normal(lg.shape)).astype(np.float32)
    base = px.BaseLogProbs.from_logits(lg)
    same = px.kl_rows(lg, tgt, base)
    assert np.abs(same["kld"]).max() < 1e-4 and same["same_top"].all()
    r = px.kl_rows(other, tgt, base)
    p, q = log_softmax64(lg), log_softmax64(other)
    want = (np.exp(p) * (p - q)).sum(axis=1)
    np.testing.assert_allclose(r["kld"], want, rtol=2e-3, atol=2e-5)
    assert (r["same_top"] == (lg.argmax(1) == other.argmax(1))).all() and not r["same_top"].all()
    np.testing.assert_allclose(r["nll"], -q[np.arange(40), tgt], atol=2e-5)
    s = px.kl_summary(r)
    assert s.mean == pytest.approx(want.mean(), rel=2e-3) and s.max == pytest.approx(want.max(), rel=2e-3)
    assert s.median == pytest.approx(np.median(want), rel=2e-3)
    assert s.ppl_ratio == pytest.approx(np.exp(r["nll"].mean(dtype=np.float64) - r["nll_base"].mean(dtype=np.float64)), rel=1e-6)


@pytest.mark.real
def test_smollm2_matches_llama_perplexity(smollm2_path):
    """-c 128, 2 chunks of the default text: PPL equal to llama-perplexity's (4 significant digits)."""
    import edgellm

    want = json.loads((Path(__file__).parent / "data" / "perplexity_llamacpp.json").read_text())["smollm2_c128_2"]
    m = edgellm.load(smollm2_path, n_ctx=128)
    r = px.perplexity(m, n_ctx=128, n_chunks=2)
    assert r.n_chunks == 2 and r.n_scored == 2 * 63
    assert float(f"{r.ppl:.4g}") == float(f"{want['ppl']:.4g}")
    assert r.ppl_err == pytest.approx(want["ppl_err"], rel=1e-3)


@pytest.mark.real
def test_smollm2_kl_matches_llama_perplexity(smollm2_path, tmp_path):
    """SmolLM2 Q4_1 against its F16 requantization (-c 128, 2 chunks): llama-perplexity's
    --kl-divergence numbers (mean/median/p99/max KL, same top p, PPL ratio) to its printed digits."""
    import edgellm

    want = json.loads((Path(__file__).parent / "data" / "perplexity_llamacpp.json").read_text())
    want = want["smollm2_q4_1_vs_f16_c128_2"]
    f16 = edgellm.quantize(smollm2_path, tmp_path / "f16.gguf", "F16", allow_requantize=True).path
    m = edgellm.load(smollm2_path, n_ctx=128)
    base = edgellm.load(f16, n_ctx=128)
    r = px.perplexity(m, n_ctx=128, n_chunks=2, base=base)
    k = r.kl
    assert round(r.ppl, 6) == pytest.approx(want["ppl"], abs=2e-6)
    assert round(k.ppl_base, 6) == pytest.approx(want["ppl_base"], abs=2e-6)
    assert round(k.ppl_ratio, 6) == pytest.approx(want["ppl_ratio"], abs=2e-6)
    for key, got in (("kl_mean", k.mean), ("kl_median", k.median), ("kl_p99", k.p99), ("kl_max", k.max)):
        assert round(got, 6) == pytest.approx(want[key], abs=2e-6), key
    assert round(k.same_top, 5) == pytest.approx(want["same_top"], abs=2e-5)


@pytest.mark.real
@pytest.mark.parametrize("name", ["smollm2_path", "gemma3_path"])
def test_first_tokens_of_a_long_text(name, request):
    """tokenize(stop_after=n): at least n ids, and they are the whole text's first ids (SPM cut where
    no token spans the cut, BPE between words), so --chunks N tokenizes only what N chunks need."""
    from edgellm.gguf_file import GGUFFile
    from edgellm.tokenizer import Tokenizer

    tok = Tokenizer.from_metadata(GGUFFile(request.getfixturevalue(name)).metadata)
    text = px.default_text()[:150_000]
    whole = tok.tokenize(text)
    assert len(whole) > 30_000
    for n in (1, 700, 5_000, 29_000):
        first = tok.tokenize(text, stop_after=n)
        assert n <= len(first) < len(whole) and first == whole[: len(first)], n
    assert tok.tokenize(text, stop_after=len(whole) + 1) == whole  # more than the text has: all of it


def test_threads_give_the_same_numbers(logits):
    """The log-softmax rows split over threads: the same bits as one thread."""
    lg, tgt = logits
    lg, tgt = np.repeat(lg, 3, axis=0), np.repeat(tgt, 3)  # 120 rows: several steps per thread
    assert np.array_equal(px.nll_rows(lg, tgt, threads=3), px.nll_rows(lg, tgt))
    base = px.BaseLogProbs.from_logits(lg[:, ::-1].copy())
    threaded = px.BaseLogProbs.from_logits(lg[:, ::-1].copy(), threads=4)
    assert all(np.array_equal(getattr(base, k), getattr(threaded, k)) for k in ("scale", "min_log_prob", "q"))
    a, b = px.kl_rows(lg, tgt, base), px.kl_rows(lg, tgt, base, threads=2)
    assert all(np.array_equal(a[k], b[k]) for k in a)
