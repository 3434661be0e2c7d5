"""Speculative decoding's parts without a model: prompt lookup, verification by the sequence's own
sampler, and the draft length chosen from acceptance and step cost."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgellm.errors import InvalidArgumentError
from edgellm.sampling import Sampler, SamplingParams
from edgellm.speculative import DraftLength, PromptLookup, SpecParams, verify


def test_lookup_proposes_what_followed_the_latest_earlier_match():
    pl = PromptLookup(max_n=3, max_m=4)
    pl.extend([1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 8, 0, 2, 3, 4])
    # suffix (2, 3, 4) occurred ending at 3 and at 9; the latest earlier one (9) is followed by 7 8 0 2
    assert pl.propose(4) == [7, 8, 0, 2]
    assert pl.propose(2) == [7, 8]
    pl.extend([7])  # (3, 4, 7) ends at 10 before; then 8 0 2 3
    assert pl.propose(8) == [8, 0, 2, 3]  # max_m caps it
    pl2 = PromptLookup(max_n=3, max_m=8)
    pl2.extend([5, 6, 7, 1, 9, 9, 6, 2])  # (9,6,2)/(6,2) unseen; (2) unseen -> nothing
    assert pl2.propose(4) == []
    pl2.extend([6])  # (2,6),(6) -> 6 seen at 1 and 6: latest earlier end 6 -> followed by 2, 6
    assert pl2.propose(4) == [2, 6]


def test_lookup_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 6, 400).tolist()
    pl = PromptLookup(max_n=3, max_m=5)
    for i, t in enumerate(toks):
        pl.extend([t])
        seq = toks[:i + 1]
        want = []
        for n in range(min(3, len(seq) - 1), 0, -1):
            suffix = seq[-n:]
            ends = [e for e in range(n - 1, len(seq) - 1) if seq[e - n + 1:e + 1] == suffix]
            if ends:
                want = seq[ends[-1] + 1:ends[-1] + 6]
                break
        assert pl.propose(5) == want, i


def _rows(n, vocab=50, seed=1):
    return np.random.default_rng(seed).standard_normal((n, vocab)).astype(np.float32) * 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_verification_draws_what_plain_decoding_draws(temperature):
    """With logits that depend only on the history, verifying any proposal gives plain decoding's
    tokens, draw for draw, for the same seed; a wrong proposal only shortens what is kept."""
    table = _rows(64, seed=3)

    def logits_after(history):
        return table[(sum(history) * 31 + len(history)) % 64]

    params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    plain_s, hist = Sampler(params), [1, 2, 3]
    plain = []
    for _ in range(40):
        t = plain_s(logits_after(hist), hist)
        plain.append(t)
        hist.append(t)
    rng = np.random.default_rng(5)
    spec_s, hist, out = Sampler(params), [1, 2, 3], []
    while len(out) < 40:
        k = int(rng.integers(0, 5))
        # a proposal that is right for a random number of tokens, then wrong
        right = int(rng.integers(0, k + 1))
        proposal = plain[len(out):len(out) + right] + [int(x) for x in rng.integers(0, 50, k - right)]
        proposal = proposal[:k]
        rows = [logits_after(hist + proposal[:i]) for i in range(len(proposal) + 1)]
        kept = verify(spec_s, rows, proposal, hist)
        assert 1 <= len(kept) <= len(proposal) + 1
        assert kept[:-1] == proposal[:len(kept) - 1]
        out += kept
        hist += kept
    assert out[:40] == plain


def test_draft_length_follows_acceptance_and_cost():
    d = DraftLength(n_max=8)
    d.record_step(1, 0.030)
    for n in range(2, 10):
        d.record_step(n, 0.030 + 0.002 * (n - 1))  # verification nearly free: bandwidth-bound decode
    for _ in range(30):
        d.record(8, 8)
    assert d.choose(8) == 8
    assert d.choose(3) == 3  # no more than there is
    for _ in range(60):
        d.record(8, 0)
    assert d.choose(8) == 0  # nothing kept: stand down
    costly = DraftLength(n_max=8, rate=0.5)
    costly.record_step(1, 0.030)
    for n in range(2, 10):
        costly.record_step(n, 0.030 * n)  # compute-bound: k+1 tokens cost k+1 steps
    assert costly.choose(8) == 0
    assert d.acceptance == pytest.approx(240 / 720)


@pytest.mark.parametrize("kw, words", [({"n_max": 0}, "must be > 0"), ({"n_max": -2}, "must be > 0"),
                                       ({"spec_type": "eagle"}, "not one of"), ({"n_min": 5, "n_max": 4}, "n-min"),
                                       ({"p_min": 1.5}, "p-min")])
def test_bad_settings_are_clear_errors(kw, words):
    with pytest.raises(InvalidArgumentError, match=words):
        SpecParams(**kw)


# --- in the engine, on the real files ------------------------------------------------------------------
import edgellm  # noqa: E402
from edgellm import scheduler  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. The dog did not move at all. Then the fox ran into "
        "the forest, where it met an old owl who lived in a tall oak tree.")
CODE = ("def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n    return result\n\n"
        "def count(items):\n    result = 0\n    for item in items:\n        result += 1\n    return result\n")
MESSAGES = {
    "repeat": "Repeat the following text exactly, word for word:\n\n" + TEXT,
    "edit": "Rewrite this code with the variable 'result' renamed to 'acc'. Show the whole code.\n\n" + CODE,
    "free": "Write a short story about a robot who learns to paint.",
}
N_TOKENS = 96


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def models(request):
    """(plain model, the same file with prompt lookup, the rendered prompts)."""
    path = request.getfixturevalue(f"{request.param}_path")
    plain = edgellm.load(path, n_ctx=512, n_batch=64)
    spec = edgellm.load(path, n_ctx=512, n_batch=64, spec_type="ngram-simple")
    prompts = {k: plain.render_chat([{"role": "user", "content": v}]) for k, v in MESSAGES.items()}
    yield plain, spec, prompts
    plain.close()
    spec.close()


@pytest.fixture
def forced(monkeypatch):
    """Every step verifies all the lookup found (no standing down), and the proposal lengths seen."""
    lengths = []
    real = scheduler.verify

    def recording(sample, rows, proposal, history):
        lengths.append(len(proposal))
        return real(sample, rows, proposal, history)

    monkeypatch.setattr(scheduler.DraftLength, "choose", lambda self, available: available)
    monkeypatch.setattr(scheduler, "verify", recording)
    return lengths


_PLAIN: dict = {}  # the plain model's answers, computed once per module


def _tokens(m, prompt, **kw):
    if m.engine.spec is None:
        key = (id(m), prompt, tuple(sorted(kw.items())))
        if key not in _PLAIN:
            _PLAIN[key] = [c.token for c in m.generate(prompt, max_tokens=N_TOKENS, **kw)], m.stats
        return _PLAIN[key]
    return [c.token for c in m.generate(prompt, max_tokens=N_TOKENS, **kw)], m.stats


@pytest.mark.real
def test_greedy_lookup_gives_the_plain_tokens(models):
    plain, spec, prompts = models
    accepted = {}
    for name, p in prompts.items():
        want, _ = _tokens(plain, p, temperature=0)
        got, st = _tokens(spec, p, temperature=0)
        assert got == want, name
        assert st.draft_n_accepted <= st.draft_n
        accepted[name] = st.draft_n_accepted
    assert accepted["repeat"] > 0  # lookup proposed and the target kept some: not vacuous


@pytest.mark.real
def test_every_step_verifying_still_gives_the_plain_tokens(models, forced):
    plain, spec, prompts = models
    cap = spec.runtime.exact_decode_rows() - 1
    total = 0
    for name, p in prompts.items():
        want, _ = _tokens(plain, p, temperature=0)
        got, st = _tokens(spec, p, temperature=0)
        assert got == want, name
        total += st.draft_n_accepted
    assert total > 0 and max(forced) >= 2
    assert max(forced) <= cap  # the whole step stays in the one-token order


@pytest.mark.real
def test_seeded_sampling_gives_the_plain_tokens(models, forced):
    plain, spec, prompts = models
    for name in ("repeat", "edit"):
        want, _ = _tokens(plain, prompts[name], temperature=0.8, seed=1234)
        got, st = _tokens(spec, prompts[name], temperature=0.8, seed=1234)
        assert got == want, name
        assert st.draft_n > 0


@pytest.mark.real
def test_max_tokens_and_stop_strings_end_mid_step(models, forced):
    plain, spec, prompts = models
    p = prompts["repeat"]
    for n in (1, 5, 9):
        got = [c.token for c in spec.generate(p, max_tokens=n, temperature=0)]
        assert got == [c.token for c in plain.generate(p, max_tokens=n, temperature=0)]
        assert len(got) == n and spec.stats.finish_reason == "length" and spec.stats.gen_tokens == n
    full = "".join(c.text for c in plain.generate(p, max_tokens=N_TOKENS, temperature=0))
    words = full.split()
    stop = words[len(words) // 2]  # a word in the middle of the answer
    want = "".join(c.text for c in plain.generate(p, max_tokens=N_TOKENS, temperature=0, stop=[stop]))
    got = "".join(c.text for c in spec.generate(p, max_tokens=N_TOKENS, temperature=0, stop=[stop]))
    assert got == want and spec.stats.finish_reason == "stop"
    assert stop not in got


@pytest.mark.real
def test_the_cache_after_speculation_serves_the_next_request(models, forced):
    plain, spec, prompts = models
    p = prompts["edit"]
    want, _ = _tokens(plain, p, temperature=0)
    first, _ = _tokens(spec, p, temperature=0)
    second, st = _tokens(spec, p, temperature=0)  # its prompt's blocks come from the cache
    assert first == second == want
    assert st.cached_tokens > 0
    # a follow-up whose prompt holds the answer: prefix blocks written by verification steps
    follow = p + spec.detokenize(first) + "\nNow do it again."
    assert _tokens(spec, follow, temperature=0)[0] == _tokens(plain, follow, temperature=0)[0]
    counts = spec.engine_stats()
    assert counts["kv_blocks_used"] == 0
    assert counts["kv_blocks_used"] + counts["kv_blocks_cached"] + counts["kv_blocks_free"] == counts["kv_blocks_total"]


@pytest.mark.real
def test_the_exact_row_cap_follows_the_weight_types(models):
    plain, spec, _ = models
    k_quants = any(t in (10, 11, 12, 13, 14) for t in {int(w.ggml_type) for L in spec.runtime.model.blocks
                                                      for w in vars(L).values() if hasattr(w, "ggml_type")})
    assert spec.runtime.exact_decode_rows() == (7 if k_quants else 16)


@pytest.mark.parametrize("kw, words", [
    ({"spec_draft_n_max": 0}, "spec_draft_n_max"), ({"spec_draft_n_max": -3}, "spec_draft_n_max"),
    ({"spec_draft_n_max": "8"}, "spec_draft_n_max"), ({"spec_type": "eagle"}, "spec_type"),
    ({"spec_draft_n_min": 9, "spec_draft_n_max": 4}, "n-min"), ({"spec_ngram_size_n": 0}, "size_n"),
    ({"spec_type": "draft-simple"}, "needs a draft model")])
def test_bad_load_settings_are_one_clear_error(kw, words):
    kw = {"spec_type": "ngram-simple", **kw}
    with pytest.raises(InvalidArgumentError, match=words):
        edgellm.load("no-such-model.gguf", **kw)  # refused before the file is looked for


def test_run_flags_refuse_bad_values_in_one_line(capsys):
    from edgellm.cli import main

    rc = main(["run", "no-such-model.gguf", "-p", "hi", "--spec-type", "ngram-simple", "--spec-draft-n-max", "0"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "--spec-draft-n-max" in err and "Traceback" not in err


@pytest.mark.real
def test_a_grammar_under_speculation_gives_the_plain_tokens(models, forced):
    """The constraint sees the kept tokens only: a JSON answer that repeats the prompt's JSON is the
    plain one, greedy and seeded, and holds the schema."""
    plain, spec, _ = models
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                        "maxItems": 4}},
              "required": ["name", "tags"]}
    p = plain.render_chat([{"role": "user", "content": 'Copy this JSON exactly: {"name": "edge llm", "tags": '
                                                         '["fast", "small", "local", "python"]}'}])
    for kw in ({"temperature": 0}, {"temperature": 0.8, "seed": 7}):
        want = [c.token for c in plain.generate(p, max_tokens=60, json_schema=schema, **kw)]
        got = [c.token for c in spec.generate(p, max_tokens=60, json_schema=schema, **kw)]
        assert got == want, kw
        assert spec.stats.draft_n_accepted > 0
        assert set(json.loads(spec.detokenize(got))) == {"name", "tags"}
