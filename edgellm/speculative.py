"""Speculative decoding: proposals, verification, and when to speculate.

A proposer offers up to n tokens that may follow a sequence: a draft model's greedy tokens, or
prompt lookup (the tokens that followed the latest earlier occurrence of the sequence's last n-gram,
llama.cpp's `ngram-simple`). The target evaluates the sequence's next token and the proposal in one
step, every position in the one-token order (so its logits are the bits plain decoding gets), and
`verify` runs the sequence's own sampler over those rows one position at a time: position i's token
is drawn exactly as plain decoding would draw it, and the walk stops at the first drawn token that
differs from the proposal. Each kept token costs one draw, as in plain decoding, so with the same
seed the answer is token for token the plain answer, greedy or sampled. For a proposal that is a
single token (a draft's greedy choice, a lookup), keeping it when the target's draw equals it is
speculative sampling's rejection rule (accept with probability p(x), else draw from p without x).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from edgellm.errors import InvalidArgumentError

SPEC_TYPES = ("none", "draft-simple", "ngram-simple")


@dataclass(frozen=True)
class SpecParams:
    """llama.cpp's names: --spec-type, --spec-draft-n-max/-n-min/-p-min,
    --spec-ngram-simple-size-n/-size-m."""

    spec_type: str = "none"
    n_max: int = 16  # the most tokens proposed in a step
    n_min: int = 0  # a proposal shorter than this is not verified
    p_min: float = 0.75  # a draft model stops proposing at a token it gives less probability
    ngram_n: int = 3  # prompt lookup: the longest n-gram matched (down to 1)
    ngram_m: int = 16  # prompt lookup: the most tokens copied after a match

    def __post_init__(self):
        if self.spec_type not in SPEC_TYPES:
            raise InvalidArgumentError(f"spec type {self.spec_type!r} is not one of {', '.join(SPEC_TYPES)}")
        if int(self.n_max) != self.n_max or self.n_max <= 0:
            raise InvalidArgumentError(f"the draft length (--spec-draft-n-max) must be > 0, got {self.n_max}")
        if int(self.n_min) != self.n_min or not 0 <= self.n_min <= self.n_max:
            raise InvalidArgumentError(f"--spec-draft-n-min must be in [0, n_max={self.n_max}], got {self.n_min}")
        if not 0.0 <= self.p_min <= 1.0:
            raise InvalidArgumentError(f"--spec-draft-p-min must be in [0, 1], got {self.p_min}")
        if self.ngram_n <= 0 or self.ngram_m <= 0:
            raise InvalidArgumentError("the n-gram sizes must be > 0")


# --- prompt lookup --------------------------------------------------------------------------------
class PromptLookup:
    """The sequence's own n-grams, indexed as tokens arrive: for each n-gram the positions where
    its two latest occurrences end, so the one before the current suffix is found in O(1)."""

    def __init__(self, max_n: int = 3, max_m: int = 16):
        self.max_n, self.max_m = max_n, max_m
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (latest end, the one before)

    def extend(self, tokens) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            e = len(self.tokens) - 1
            for n in range(1, min(self.max_n, e + 1) + 1):
                key = tuple(self.tokens[e - n + 1:e + 1])
                last = self._ends.get(key)
                self._ends[key] = (e, last[0] if last else -1)

    def truncate(self, n_keep: int) -> None:
        """Forget tokens past n_keep (not needed by the engine, which only appends kept tokens)."""
        if n_keep < len(self.tokens):
            kept = self.tokens[:n_keep]
            self.tokens, self._ends = [], {}
            self.extend(kept)

    def propose(self, n_draft: int) -> list[int]:
        """Up to n_draft tokens that followed the latest earlier occurrence of the longest matching
        suffix (max_n tokens down to 1); [] when there is none."""
        toks, e = self.tokens, len(self.tokens) - 1
        n_draft = min(n_draft, self.max_m)
        if e < 1 or n_draft <= 0:
            return []
        for n in range(min(self.max_n, e), 0, -1):
            ends = self._ends.get(tuple(toks[e - n + 1:e + 1]))
            if ends is None:
                continue
            prev = ends[1] if ends[0] == e else ends[0]
            if prev >= 0:
                return toks[prev + 1:prev + 1 + n_draft]
        return []


# --- verification ---------------------------------------------------------------------------------
def verify(sample, rows, proposal: list[int], history: list[int]) -> list[int]:
    """The tokens kept from one verification step: `rows[i]` are the target's logits after the
    sequence's tokens and proposal[:i]; `sample(logits, history)` is the sequence's sampler. Returns
    1 + (number of proposed tokens kept) tokens: the kept proposal tokens, then the target's own."""
    kept: list[int] = []
    hist = list(history)
    for i in range(len(proposal) + 1):
        t = int(sample(rows[i], hist))
        kept.append(t)
        if i == len(proposal) or t != proposal[i]:
            break
        hist.append(t)
    return kept


# --- when to speculate ------------------------------------------------------------------------------
# The acceptance a probe assumes: about the best a draft keeps on text it predicts well (a small
# draft of code for its larger sibling: docs/performance.md). A length that would pay only at a higher rate
# is never probed: the probe's drafting and the draft's catch-up cost more than it could win.
PROBE_RATE = 0.95
# Until measured, with a draft model: a verification row costs ROW_PRIOR of a one-token step (the
# one-token order computes every row: docs/performance.md), and a draft step the size ratio times
# DRAFT_PRIOR_SCALE (a smaller model reads its weights at a lower rate). Guessed low, a new request drafts, and pays the draft's catch-up, where
# no length pays.
ROW_PRIOR = 0.45
# A draft model's probe also makes the draft catch up on the tokens since its last proposal: a
# probe is made only where a length would gain this much
PROBE_MARGIN = 1.10
DRAFT_PRIOR_SCALE = 1.3


@dataclass
class DraftLength:
    """How many tokens to propose: the length that maximises expected kept tokens per unit of step
    time, from the running acceptance rate (per proposed token, exponentially weighted) and the
    measured step time of each size relative to a one-token step. 0 stands speculation down."""

    n_max: int
    n_min: int = 0
    rate: float = 0.7  # prior acceptance per proposed token
    decay: float = 0.9
    step_s: dict = field(default_factory=dict)  # tokens in a step -> EWMA seconds
    draft_s: dict = field(default_factory=dict)  # a draft model's one-token step: {1: EWMA seconds}
    drafting: bool = False  # proposals cost a draft model's steps
    draft_prior: float = 0.3  # a draft step in target steps until one is measured (the size ratio)
    proposed: int = 0
    accepted: int = 0

    def record_step(self, n_tokens: int, seconds: float) -> None:
        old = self.step_s.get(n_tokens)
        self.step_s[n_tokens] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def record(self, n_proposed: int, n_accepted: int) -> None:
        """One verification: n_accepted of n_proposed tokens kept (a prefix)."""
        if n_proposed <= 0:
            return
        self.proposed += n_proposed
        self.accepted += n_accepted
        # each proposed token up to the first rejection is one Bernoulli trial
        trials = min(n_proposed, n_accepted + 1)
        for i in range(trials):
            self.rate = self.decay * self.rate + (1 - self.decay) * (1.0 if i < n_accepted else 0.0)

    def cost(self, n_tokens: int) -> float:
        """A step of n_tokens in units of a one-token step (interpolated; assumed flat when unknown:
        on a bandwidth-bound CPU a few more rows cost little next to reading the weights)."""
        one = self.step_s.get(1)
        if not one or max(self.step_s) == 1:  # no larger step measured yet: the prior (a draft's
            return 1.0 + (ROW_PRIOR if self.drafting else 0.05) * (n_tokens - 1)  # tokens are dearer to try)
        known = sorted(k for k in self.step_s if k >= n_tokens)
        if known:
            return self.step_s[known[0]] / one
        top = max(self.step_s)
        return self.step_s[top] / one * n_tokens / top

    def choose(self, available: int, rate: float | None = None, margin: float = 1.03) -> int:
        """The draft length for the next step, given `available` proposed tokens (0..n_max), at the
        running acceptance rate (or `rate`): the best length whose gain beats plain decoding by
        `margin` (speculation must pay for itself clearly); 0 when none does."""
        best_k, best = 0, 1.0
        if self.drafting and 1 not in self.step_s:  # a plain step's cost first: a draft's steps cost too
            return 0
        a = min(max(self.rate if rate is None else rate, 0.0), 0.999)
        one, drafted = self.step_s.get(1), self.draft_s.get(1)
        per_draft = drafted / one if one and drafted else (DRAFT_PRIOR_SCALE * self.draft_prior if self.drafting
                                                           else 0.0)
        for k in range(max(self.n_min, 1), min(self.n_max, available) + 1):
            expected = (1 - a ** (k + 1)) / (1 - a)  # kept tokens, the target's own included
            gain = expected / (self.cost(k + 1) + k * per_draft)
            if gain > best * margin:
                best_k, best = k, gain
        if best_k and best_k < self.n_min:
            return 0
        return best_k

    def could_pay(self, available: int) -> bool:
        """Whether any draft length would pay at a good acceptance rate (PROBE_RATE): when not, at
        the measured costs, no realistic rate brings speculation back (a probe is wasted)."""
        return self.probe_length(available) > 0

    def probe_length(self, available: int) -> int:
        """The length a probe verifies: the one that pays best at PROBE_RATE (0: none pays)."""
        return self.choose(available, rate=PROBE_RATE, margin=PROBE_MARGIN if self.drafting else 1.03)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else math.nan


# --- a draft model: can it draft for the target? -------------------------------------------------
VOCAB_MAX_SIZE_DIFF = 128  # llama.cpp's bound on the two vocabularies' sizes
VOCAB_CHECK_START = 5  # ... and the first id whose text it compares


def check_draft(target, draft) -> None:
    """A clear error unless `draft` can draft for `target` (each a Model, or a (tokenizer, GGUFFile)
    pair, checked before the weights are read): the same tokenizer, the same special tokens and
    token texts (llama.cpp's checks), and a smaller file."""
    (tt, tgf), (dt, dgf) = [(m.tokenizer, m.gf) if hasattr(m, "tokenizer") else m for m in (target, draft)]
    name = f"the draft model {dgf.path}"
    if tt.kind != dt.kind:
        raise InvalidArgumentError(f"{name} has a {dt.kind} tokenizer, the target a {tt.kind} one: "
                                   "a draft needs the target's vocabulary")
    for what in ("bos_id", "eos_id", "add_bos"):
        if getattr(tt, what) != getattr(dt, what):
            raise InvalidArgumentError(f"{name}'s {what} is {getattr(dt, what)}, the target's "
                                       f"{getattr(tt, what)}: a draft needs the target's vocabulary")
    if abs(tt.n_vocab - dt.n_vocab) > VOCAB_MAX_SIZE_DIFF:
        raise InvalidArgumentError(f"{name} has {dt.n_vocab} tokens, the target {tt.n_vocab}: "
                                   "a draft needs the target's vocabulary")
    for i in range(VOCAB_CHECK_START, min(tt.n_vocab, dt.n_vocab)):
        if tt._tokens[i] != dt._tokens[i]:
            raise InvalidArgumentError(f"{name}'s token {i} is {dt._tokens[i]!r}, the target's "
                                       f"{tt._tokens[i]!r}: a draft needs the target's vocabulary")
    if dgf.file_size > tgf.file_size:
        raise InvalidArgumentError(f"{name} ({dgf.file_size / 2**20:.0f} MiB) is larger than the target "
                                   f"({tgf.file_size / 2**20:.0f} MiB): the draft must be the smaller model")


# --- a draft model ----------------------------------------------------------------------------------
class DraftModel:
    """A smaller model with the target's vocabulary, proposing its greedy tokens. Each target
    sequence has a sequence in the draft's own KV cache, holding a prefix of the target's tokens;
    tokens the target rejects are cut back (the draft cache's rollback margin)."""

    def __init__(self, runtime, *, n_vocab: int, n_batch: int, n_max: int, p_min: float, lock=None):
        self.runtime = runtime
        self.n_vocab = n_vocab  # proposals are target ids: the draft's extra rows are never proposed
        self.n_batch = n_batch
        self.p_min = p_min
        self.lock = lock or threading.RLock()
        runtime.cache.rollback = n_max + 1
        self.step_s: dict = {}  # {1: EWMA seconds per proposed token} (DraftLength.draft_s)
        self._rest = 0  # tokens the last proposal caught up on
        self.size_ratio = 0.3  # draft / target weight bytes (set by the target): a draft step's prior cost

    def new_sequence(self):
        return self.runtime.cache.new_sequence()

    def propose(self, dkv, tokens: list[int], k: int) -> list[int]:
        """Up to k greedy draft tokens after `tokens` (the target's sequence and its next token),
        stopping after one the draft gives less than p_min; [] when the draft cache is short."""
        t0 = time.perf_counter()
        with self.lock:
            out = self._propose(dkv, tokens, k)
        if out and self._rest <= 2:  # a proposed token's cost, the steady catch-up (the target's last
            per = (time.perf_counter() - t0) / len(out)
            old = self.step_s.get(1)
            self.step_s[1] = per if old is None else 0.8 * old + 0.2 * per  # tokens) included
        return out

    def _propose(self, dkv, tokens, k):
        n = 0
        while n < min(dkv.n_past, len(tokens)) and dkv.tokens[n] == tokens[n]:
            n += 1
        if dkv.n_past == 0:  # a new sequence: the draft cache's longest cached prefix (a chat's turns)
            dkv.reuse_prefix(tokens)
        elif n < dkv.n_past:
            try:
                dkv.truncate(n)
            except InvalidArgumentError:  # beyond the margin (a preemption): start over
                dkv.free()
                dkv.reuse_prefix(tokens)
        rest = tokens[dkv.n_past:]
        self._rest = len(rest)
        logits = None
        for c in range(0, len(rest), self.n_batch):
            chunk = rest[c:c + self.n_batch]
            if not dkv.grow(len(chunk)):
                return []
            logits = self.runtime.forward([(dkv, np.asarray(chunk, np.int64))], rows=[len(chunk) - 1])
        if logits is None:  # the draft holds every token already (cannot happen: the last is new)
            return []
        out: list[int] = []
        while True:
            row = logits[-1, :self.n_vocab].astype(np.float64)
            tok = int(np.argmax(row))
            p = 1.0 / float(np.sum(np.exp(row - row[tok])))
            out.append(tok)
            if len(out) >= k or p < self.p_min or not dkv.grow(1):
                return out
            logits = self.runtime.forward([(dkv, np.asarray([tok], np.int64))], rows=[0])

    def release(self, dkv) -> None:
        with self.lock:
            dkv.free()
