"""Speculative decoding with a draft model (llama.cpp's draft-simple) on the real files: the target's
own tokens, greedy and sampled; the draft cache cut back to what the target kept; bad drafts refused."""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

import edgellm
from edgellm import scheduler
from edgellm.errors import EdgeLLMError, InvalidArgumentError
from edgellm.kv_cache import KVCache
from edgellm.speculative import DraftLength

pytestmark = pytest.mark.real

TOPICS = ["a lighthouse keeper", "a robot who paints", "the first snow", "a lost key", "a quiet library",
          "a dragon who bakes", "a train at night", "an old map", "a garden on Mars", "a clock that runs back",
          "a talking cat", "the last bus", "a river in spring", "a violin in the attic", "a city of glass",
          "a fox and a crow", "a storm at sea", "a broken compass", "a summer market", "a letter never sent"]


@pytest.fixture(scope="module")
def pair(smollm2_path):
    """(SmolLM2 alone, SmolLM2 drafting for itself)."""
    plain = edgellm.load(smollm2_path, n_ctx=512, n_batch=64)
    spec = edgellm.load(smollm2_path, n_ctx=512, n_batch=64, draft=smollm2_path, spec_draft_p_min=0.0)
    yield plain, spec
    plain.close()
    spec.close()


@pytest.fixture
def forced(monkeypatch):
    """Every step proposes as many draft tokens as fit (no standing down)."""
    monkeypatch.setattr(scheduler.DraftLength, "choose", lambda self, available: available)


def test_greedy_with_a_draft_gives_the_targets_tokens(pair, forced):
    """20 fresh prompts x 128 tokens: the same tokens as the target alone; the draft proposed and
    most of it was kept (the same file as draft: it differs only where its batched catch-up
    order flips a near-tie), and the draft's cache holds no block after."""
    plain, spec = pair
    proposed = accepted = 0
    for topic in TOPICS:
        p = plain.render_chat([{"role": "user", "content": f"Write a short story about {topic}."}])
        want = [c.token for c in plain.generate(p, max_tokens=128, temperature=0)]
        got = [c.token for c in spec.generate(p, max_tokens=128, temperature=0)]
        assert got == want, topic
        proposed += spec.stats.draft_n
        accepted += spec.stats.draft_n_accepted
    assert proposed > 20 * 60 and accepted > 0.5 * proposed
    counts = spec.draft.engine_stats()
    assert counts["kv_blocks_used"] == 0
    assert counts["kv_blocks_used"] + counts["kv_blocks_cached"] + counts["kv_blocks_free"] == counts["kv_blocks_total"]


def test_a_different_draft_gives_the_targets_tokens(qwen05_path, qwen15_path, forced):
    """Qwen2.5-Coder-1.5B with the 0.5B drafting: drafts that differ from the target are cut back
    and the answer is the target's."""
    plain = edgellm.load(qwen15_path, n_ctx=512)
    spec = edgellm.load(qwen15_path, n_ctx=512, draft=qwen05_path)
    try:
        for ask in ("Write a Python function that reverses a string.", "Explain what a mutex is in one sentence."):
            p = plain.render_chat([{"role": "user", "content": ask}])
            want = [c.token for c in plain.generate(p, max_tokens=48, temperature=0)]
            got = [c.token for c in spec.generate(p, max_tokens=48, temperature=0)]
            assert got == want, ask
            assert 0 < spec.stats.draft_n_accepted < spec.stats.draft_n
    finally:
        plain.close()
        spec.close()


# --- sampling: the target's distribution -----------------------------------------------------------
def _chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:  # series for P, then 1 - P
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    b, c, d = z + 1 - a, 1e300, 1.0 / (z + 1 - a)  # Lentz's continued fraction for Q
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return h * math.exp(-z + a * math.log(z) - math.lgamma(a))


def test_chi2_tail_matches_known_values():
    assert _chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert _chi2_sf(23.209251158954356, 10) == pytest.approx(0.01, rel=1e-6)
    assert _chi2_sf(5.0, 10) == pytest.approx(0.8911780189141512, rel=1e-6)


def _two_sample_p(a: list, b: list) -> float:
    """Chi-square test that two samples of categories come from one distribution (categories
    seen fewer than 10 times in both together pooled into one)."""
    ca, cb = Counter(a), Counter(b)
    keys = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    rest = [k for k in set(ca) | set(cb) if ca[k] + cb[k] < 10]
    rows = np.array([[ca[k] for k in keys] + [sum(ca[k] for k in rest)],
                     [cb[k] for k in keys] + [sum(cb[k] for k in rest)]], float)
    rows = rows[:, rows.sum(0) > 0]
    expected = rows.sum(1, keepdims=True) * rows.sum(0, keepdims=True) / rows.sum()
    stat = float(((rows - expected) ** 2 / expected).sum())
    return _chi2_sf(stat, rows.shape[1] - 1)


N_SEEDS = 2000
PROMPT = "My favourite thing about the weekend is"


def _first_three(m, seeds):
    return [tuple(c.token for c in m.generate(PROMPT, max_tokens=3, temperature=1.0, seed=s)) for s in seeds]


@pytest.fixture(scope="module")
def alone(pair):
    plain, _ = pair
    return _first_three(plain, range(N_SEEDS))


def _p_values(alone, drafted):
    return [_two_sample_p([t[i] for t in alone], [t[i] for t in drafted]) for i in range(3)]


def test_sampling_with_a_draft_keeps_the_targets_distribution(pair, alone, forced):
    """Temperature 1, 2,000 seeds each (other seeds than the target-alone sample's): the first three
    tokens' distributions match the target alone's (chi-square p > 0.01 at each position)."""
    _, spec = pair
    drafted = _first_three(spec, range(10_000, 10_000 + N_SEEDS))
    assert spec.stats.draft_n > 0
    p = _p_values(alone, drafted)
    assert min(p) > 0.01, p


def test_a_broken_acceptance_rule_fails_the_same_test(pair, alone, forced, monkeypatch):
    """Keeping every proposed token (the draft's greedy choice) instead of the target's draw: the
    same test sees it."""

    def keep_all(sample, rows, proposal, history):
        return list(proposal) + [int(sample(rows[len(proposal)], list(history) + list(proposal)))]

    monkeypatch.setattr(scheduler, "verify", keep_all)
    _, spec = pair
    drafted = _first_three(spec, range(10_000, 10_000 + N_SEEDS))
    p = _p_values(alone, drafted)
    assert min(p) < 0.01, p


# --- the draft's cache ----------------------------------------------------------------------------------
def test_the_draft_cache_cuts_back_within_its_margin(smollm2_path):
    m = edgellm.load(smollm2_path, n_ctx=256, n_batch=64)
    try:
        cache = KVCache(m.config, m.runtime.model.layer_backends, n_ctx=256, n_batch=64, n_seq=1)
        cache.rollback = 5
        seq = cache.new_sequence()
        seq.grow(40)
        seq.commit(list(range(40)))
        assert seq.n_past == 40 and seq.n_registered == (40 - 5) // cache.block_size
        seq.truncate(36)
        assert seq.tokens == list(range(36))
        with pytest.raises(InvalidArgumentError, match="cannot cut"):
            seq.truncate(36 - 6)
        seq.free()
        assert cache.block_counts()["used"] == 0
    finally:
        m.close()


def test_draft_length_waits_for_a_plain_steps_cost():
    d = DraftLength(n_max=8, drafting=True, rate=0.99)
    assert d.choose(8) == 0  # no plain step measured yet: a draft's steps may not pay
    d.record_step(1, 0.030)
    for n in range(2, 10):
        d.record_step(n, 0.030 + 0.001 * n)
    d.draft_s[1] = 0.003
    assert d.choose(8) == 8
    assert d.could_pay(8)
    d.draft_s[1] = 0.030  # a draft as slow as the target: never pays, whatever it would keep
    assert d.choose(8) == 0 and not d.could_pay(8)


def test_no_probe_when_only_a_perfect_draft_would_pay():
    """A draft at half a target step with verification rows at 0.4 (about the Qwen 0.5B / 1.5B pair
    here): every token kept would pay a little, a realistic rate (PROBE_RATE) would not, so the
    engine neither drafts nor probes; a cheaper draft is probed at the length that pays best."""
    from edgellm.speculative import PROBE_RATE

    d = DraftLength(n_max=16, drafting=True, rate=0.92)
    d.record_step(1, 0.020)
    for n in range(2, 9):
        d.record_step(n, 0.020 * (1 + 0.4 * (n - 1)))
    d.draft_s[1] = 0.010
    assert d.choose(16, rate=0.9999) > 0  # only were every token kept
    assert d.choose(16) == 0 and not d.could_pay(16) and d.probe_length(16) == 0
    d.draft_s[1] = 0.002
    k = d.probe_length(16)
    assert d.could_pay(16) and 0 < k == d.choose(16, rate=PROBE_RATE)


def test_the_plan_counts_the_draft(pair, smollm2_path):
    """The target's plan holds the draft's weights, KV cache and activations (its own plan's) in a
    `draft` row of the CPU ledger, in the total; `edgellm plan -md` shows the same row."""
    import subprocess
    import sys

    plain, spec = pair
    d = spec.draft.plan.cpu
    assert spec.plan.cpu.draft == d.weights + d.kv_cache + d.activations > 0 and plain.plan.cpu.draft == 0
    assert spec.plan.cpu.total - plain.plan.cpu.total >= spec.plan.cpu.draft  # (and its share of the margin)
    mem = spec.memory()["cpu"]
    assert mem["draft_weights"] == d.weights and mem["draft_kv_cache"] == d.kv_cache
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "plan", str(smollm2_path), "-md", str(smollm2_path),
                        "-c", "512", "-b", "64", "--ram", "8GiB"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("draft"))
    from edgellm.memory import format_size

    assert row.split()[1:3] == format_size(spec.plan.cpu.draft).split()


def test_a_draft_that_cannot_pay_is_never_run(pair):
    """SmolLM2 drafting for itself: a draft step costs a target step, so no acceptance rate could
    pay for it; the engine does not draft (nor probe) and the answer is the plain one."""
    plain, spec = pair
    p = plain.render_chat([{"role": "user", "content": "Write a short story about a red kite."}])
    want = [c.token for c in plain.generate(p, max_tokens=64, temperature=0)]
    assert [c.token for c in spec.generate(p, max_tokens=64, temperature=0)] == want
    assert spec.stats.draft_n == 0


# --- bad drafts ---------------------------------------------------------------------------------------
def test_a_draft_with_another_vocabulary_is_refused(smollm2_path, gemma3_path):
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        edgellm.load(smollm2_path, draft=gemma3_path)


def test_a_draft_larger_than_the_target_is_refused(qwen05_path, qwen15_path):
    with pytest.raises(InvalidArgumentError, match="larger than the target"):
        edgellm.load(qwen05_path, draft=qwen15_path)


def test_a_draft_that_fails_to_load_is_one_clear_error(smollm2_path, tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(open(smollm2_path, "rb").read(4096))  # a truncated file
    with pytest.raises(EdgeLLMError, match="draft.gguf"):
        edgellm.load(smollm2_path, draft=str(bad))
    with pytest.raises(EdgeLLMError, match="nothing-here"):
        edgellm.load(smollm2_path, draft="nothing-here.gguf")


@pytest.mark.parametrize("kw, words", [({"spec_type": "draft-simple"}, "needs a draft model"),
                                       ({"draft": "x.gguf", "spec_type": "ngram-simple"}, "draft-simple"),
                                       ({"draft": "x.gguf", "spec_draft_n_max": 0}, "spec_draft_n_max"),
                                       ({"draft": "x.gguf", "spec_draft_p_min": 2}, "p_min"),
                                       ({"draft": 3}, "draft must be")])
def test_bad_draft_settings_are_one_clear_error(kw, words):
    with pytest.raises(InvalidArgumentError, match=words):
        edgellm.load("no-such-model.gguf", **kw)  # refused before any file is looked for


def test_run_flags_for_a_draft(capsys):
    from edgellm.cli import main

    rc = main(["run", "no-such-model.gguf", "-p", "hi", "--spec-type", "draft-simple"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "--model-draft" in err and "Traceback" not in err
    rc = main(["run", "no-such-model.gguf", "-p", "hi", "-md", "d.gguf", "--draft-max", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "--spec-draft-n-max" in err
