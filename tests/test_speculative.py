"""Speculative decoding's parts without a model: prompt lookup, verification by the sequence's own
sampler, and the draft length chosen from acceptance and step cost."""
from __future__ import annotations

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
