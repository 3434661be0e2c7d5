"""Sampling: repetition penalty → greedy, or top-k → top-p → min-p → temperature → draw.

The order matches llama.cpp's default sampler chain (penalties, top_k, top_p, min_p, temp, dist).
A seed makes draws reproducible; temperature 0 is greedy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgellm.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self):
        def bad(what):
            raise InvalidArgumentError(what)

        if not np.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not np.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            bad(f"repeat_penalty must be > 0 (1 = off), got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            bad(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")
        if self.seed is not None and (int(self.seed) != self.seed or self.seed < 0):
            bad(f"seed must be a non-negative integer, got {self.seed}")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int] = ()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repeat_penalty != 1.0 and len(history) and p.repeat_last_n:
            logits = logits.copy()
            recent = np.unique(np.asarray(history[-p.repeat_last_n :], dtype=np.int64))
            vals = logits[recent]
            # llama.cpp: positive logits divided, negative multiplied
            logits[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if p.temperature == 0:
            return int(np.argmax(logits))
        return self._draw(logits)

    def _draw(self, logits: np.ndarray) -> int:
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
