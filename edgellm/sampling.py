"""Sampling: repetition penalty → greedy, or top-k → top-p → min-p → temperature → draw.

The order matches llama.cpp's default sampler chain (penalties, top_k, top_p, min_p, temp, dist).
A seed makes draws reproducible; temperature 0 is greedy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from edgellm.errors import InvalidArgumentError

# The one home of the sampling defaults (llama.cpp's): the API (`Model.generate` / `chat`), the
# command line (`run`, `chat`) and the chat UI all read these.
TEMPERATURE = 0.8
TOP_K = 40
TOP_P = 0.95
MIN_P = 0.05
REPEAT_PENALTY = 1.0  # 1 = off
REPEAT_LAST_N = 64
MAX_TOKENS = 256  # a completion (API, `edgellm run -n`)
CHAT_MAX_TOKENS = 1024  # the longest answer of a chat turn (`edgellm chat`, the UI's settings)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = TEMPERATURE
    top_k: int = TOP_K
    top_p: float = TOP_P
    min_p: float = MIN_P
    repeat_penalty: float = REPEAT_PENALTY
    repeat_last_n: int = REPEAT_LAST_N
    seed: int | None = None

    def __post_init__(self):
        def bad(what):
            raise InvalidArgumentError(what)

        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            bad(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            bad(f"seed must be a non-negative integer, got {self.seed}")


class Sampler:
    """Draws one token from logits; with a grammar constraint (edgellm.grammar), draws from the
    free distribution first and masks and draws again only when the grammar refuses the token
    (llama.cpp's order), then advances the grammar."""

    def __init__(self, params: SamplingParams, constraint=None):
        import numpy as np  # here, so that the command line reads the defaults without NumPy

        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.constraint = constraint

    def __call__(self, logits, history: list[int] = ()) -> int:
        import numpy as np

        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repeat_penalty != 1.0 and len(history) and p.repeat_last_n:
            logits = logits.copy()
            recent = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            vals = logits[recent]
            # llama.cpp: positive logits divided, negative multiplied
            logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        tok = self._pick(logits)
        c = self.constraint
        if c is not None:
            if not c.allows(tok):
                c.masked += 1
                tok = self._pick(c.mask(logits))
            c.accept(tok)
        return tok

    def _pick(self, logits) -> int:
        import numpy as np

        if self.params.temperature == 0:
            return int(np.argmax(logits))
        return self._draw(logits)

    def _draw(self, logits) -> int:
        import numpy as np

        p = self.params
        n = len(logits)
        k = n if p.top_k == 0 else min(p.top_k, n)
        if k < n:
            idx = np.argpartition(-logits, k - 1)[:k]
        else:
            idx = np.arange(n)
        idx = idx[np.argsort(-logits[idx], kind="stable")]  # descending
        z = logits[idx].astype(np.float64)
        probs = np.exp(z - z[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p) + 1)  # smallest set with mass >= top_p
            idx, z = idx[:keep], z[:keep]
            probs = probs[:keep]
        if p.min_p > 0:
            keep = probs >= p.min_p * probs[0]
            idx, z = idx[keep], z[keep]
        z = z / p.temperature
        w = np.exp(z - z.max())
        w /= w.sum()
        return int(idx[self.rng.choice(len(idx), p=w)])
