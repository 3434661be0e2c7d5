"""Perplexity and KL divergence with llama-perplexity's protocol and arithmetic.

Protocol: the text is tokenized once (BOS first when the vocabulary adds one), cut into chunks of
n_ctx tokens (as many whole chunks as fit, or the first `n_chunks`); each chunk runs in a fresh
context with its first token replaced by BOS; only the second half is scored: the logits at
positions n_ctx/2 .. n_ctx-2 predict the next token, n_ctx/2 - 1 scores per chunk. PPL = exp(mean
NLL) and its ± is PPL * sqrt(var(NLL) / (count - 1)).

With a base model the same chunks also run through the base, and what llama-perplexity's
--kl-divergence reports is computed the way it computes it: the base's log-probabilities stored as
16-bit steps between max-16 and max per position (its logits file format), KL(base || model) summed
over the tokens whose base log-probability exceeds -16, "same top p" = how often both argmaxes agree.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from edgellm.errors import InvalidArgumentError

ROWS_PER_STEP = 16  # logit rows reduced at once (Gemma-3: 16 x 262144 floats = 16 MiB per temporary)


# ============================================================================ text and chunks
def default_text() -> str:
    """~465 K characters of English that ship with every Python: the pydoc topic help texts."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def read_text(path: str | Path | None) -> str:
    if path is None:
        return default_text()
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise InvalidArgumentError(f"{path}: cannot read the text file ({exc.strerror})") from None


def make_chunks(tokens: list[int], n_ctx: int, n_chunks: int | None, bos: int | None) -> np.ndarray:
    """int64 (n_chunks, n_ctx): whole chunks of the token stream, each starting with BOS if given."""
    if n_ctx < 4:
        raise InvalidArgumentError(f"-c {n_ctx}: the context must be at least 4 tokens")
    if len(tokens) < 2 * n_ctx:
        raise InvalidArgumentError(f"the text has {len(tokens)} tokens; at least {2 * n_ctx} are needed for "
                                   f"-c {n_ctx} (a longer text, or a smaller -c)")
    n_max = len(tokens) // n_ctx
    n = n_max if n_chunks is None or n_chunks <= 0 else min(n_chunks, n_max)
    chunks = np.asarray(tokens[: n * n_ctx], dtype=np.int64).reshape(n, n_ctx).copy()
    if bos is not None:
        chunks[:, 0] = bos
    return chunks


# ============================================================================ per-position scores
def _max_and_lse(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, V) float32 -> (max (rows,) float32, log(sum exp(l - max)) (rows,) float64): float32
    exponentials summed in double, as llama-perplexity's log_softmax."""
    mx = logits.max(axis=1)
    s = np.exp(logits - mx[:, None]).sum(axis=1, dtype=np.float64)
    return mx, np.log(s)


def _each_step(n: int, fn: Callable[[slice], None], threads: int) -> None:
    """fn(rows) for every ROWS_PER_STEP rows of n, on `threads` threads (NumPy lets go of the GIL
    in its reductions); each step's arithmetic is the same whichever thread runs it."""
    steps = [slice(r0, min(n, r0 + ROWS_PER_STEP)) for r0 in range(0, n, ROWS_PER_STEP)]
    if threads <= 1 or len(steps) <= 1:
        for sl in steps:
            fn(sl)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(fn, steps))


def nll_rows(logits: np.ndarray, targets: np.ndarray, threads: int = 1) -> np.ndarray:
    """(n, V) float32 logits, (n,) next tokens -> (n,) float64 negative log-likelihoods."""
    out = np.empty(len(targets), dtype=np.float64)

    def step(sl: slice) -> None:
        lg = logits[sl]
        mx, lse = _max_and_lse(lg)
        tgt = lg[np.arange(len(lg)), targets[sl]]
        out[sl] = -((tgt - mx).astype(np.float64) - lse)

    _each_step(len(targets), step, threads)
    return out


@dataclass
class BaseLogProbs:
    """The base model's log-probabilities per scored position, in llama-perplexity's 16-bit form:
    log p_i ≈ scale * q_i + min_log_prob, q uint16 (n, V)."""

    scale: np.ndarray  # (n,) float32
    min_log_prob: np.ndarray  # (n,) float32
    q: np.ndarray  # (n, V) uint16

    @classmethod
    def from_logits(cls, logits: np.ndarray, threads: int = 1) -> "BaseLogProbs":
        n, v = logits.shape
        scale = np.empty(n, np.float32)
        min_lp = np.empty(n, np.float32)
        q = np.empty((n, v), np.uint16)

        def step(sl: slice) -> None:
            lg = logits[sl]
            mx, lse = _max_and_lse(lg)
            mn = np.maximum(lg.min(axis=1), mx - np.float32(16))
            lse32 = lse.astype(np.float32)
            min_lp[sl] = (mn - mx) - lse32
            scale[sl] = (mx - mn) / np.float32(65535)
            with np.errstate(divide="ignore", invalid="ignore"):
                inv = np.where(scale[sl] != 0, np.float32(1) / scale[sl], np.float32(0))
                steps = np.rint(inv[:, None] * (lg - mn[:, None]))  # ggml's nearest_int: half to even
            q[sl] = np.where(lg > mn[:, None], steps, 0).astype(np.uint16)

        _each_step(n, step, threads)
        return cls(scale, min_lp, q)


def kl_rows(logits: np.ndarray, targets: np.ndarray, base: BaseLogProbs, threads: int = 1) -> dict[str, np.ndarray]:
    """Per position: nll and nll_base (float32, as llama-perplexity keeps them), KL(base || model)
    (float64), same_top (bool), p_diff = p(target) - p_base(target) (float32)."""
    n = len(targets)
    out = {"nll": np.empty(n, np.float32), "nll_base": np.empty(n, np.float32), "kld": np.empty(n, np.float64),
           "same_top": np.empty(n, bool), "p_diff": np.empty(n, np.float32)}

    def step(sl: slice) -> None:
        lg = logits[sl]
        rows = np.arange(len(lg))
        tgt = targets[sl]
        mx, lse = _max_and_lse(lg)
        lse32 = lse.astype(np.float32)
        nll = (mx + lse32) - lg[rows, tgt]
        p_log_base = base.scale[sl, None] * base.q[sl].astype(np.float32) + base.min_log_prob[sl, None]
        nll_base = -p_log_base[rows, tgt]
        top = mx + lse32
        keep = p_log_base > np.float32(-16)
        terms = np.exp(p_log_base) * ((p_log_base - lg) + top[:, None])
        out["kld"][sl] = np.where(keep, terms, np.float32(0)).sum(axis=1, dtype=np.float64)
        out["same_top"][sl] = lg.argmax(axis=1) == p_log_base.argmax(axis=1)
        out["nll"][sl], out["nll_base"][sl] = nll, nll_base
        out["p_diff"][sl] = np.exp(-nll) - np.exp(-nll_base)

    _each_step(n, step, threads)
    return out


# ============================================================================ statistics
def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """llama-perplexity's mean ± sqrt(var / (count - 1)) (0 for fewer than 11 values)."""
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n < 1:
        return 0.0, 0.0
    f = v.sum() / n
    df = (v * v).sum() / n - f * f
    return float(f), float(np.sqrt(df / (n - 1))) if df > 0 and n > 10 else 0.0


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama-perplexity's interpolated percentile of sorted values."""
    v = sorted_values
    p = np.float32(fraction) * np.float32(len(v) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)])


@dataclass
class KLResult:
    mean: float
    mean_err: float
    median: float
    p99: float
    max: float
    same_top: float  # fraction of positions whose argmax equals the base's
    same_top_err: float
    ppl_base: float
    ppl_ratio: float  # PPL(model) / PPL(base)
    ppl_ratio_err: float
    rms_p_diff: float


def kl_summary(acc: dict[str, np.ndarray]) -> KLResult:
    n = len(acc["kld"])
    nll, nll_b = acc["nll"].astype(np.float64), acc["nll_base"].astype(np.float64)
    kl, kl_err = mean_and_uncertainty(acc["kld"])
    srt = np.sort(acc["kld"].astype(np.float32))
    median = float(0.5 * (srt[n // 2] + srt[n // 2 - 1])) if n % 2 == 0 else float(srt[n // 2])
    lp, lp_err = mean_and_uncertainty(nll)
    lb, lb_err = mean_and_uncertainty(nll_b)
    cov = ((nll * nll_b).sum() / n - (nll.sum() / n) * (nll_b.sum() / n)) / (n - 1) if n >= 10 else 0.0
    ratio_err = float(np.sqrt(max(lp_err**2 + lb_err**2 - 2 * cov, 0.0)))
    top = float(acc["same_top"].mean())
    p2 = acc["p_diff"].astype(np.float64) ** 2
    return KLResult(kl, kl_err, median, percentile(srt, 0.99), float(srt[-1]), top,
                    float(np.sqrt(top * (1 - top) / (n - 1))) if n > 1 else 0.0,
                    float(np.exp(lb)), float(np.exp(lp - lb)), float(np.exp(lp - lb) * ratio_err),
                    float(np.sqrt(p2.mean())))


@dataclass
class PerplexityResult:
    ppl: float
    ppl_err: float
    n_ctx: int
    n_chunks: int
    n_scored: int  # positions scored in all
    n_text_tokens: int  # tokens of the text read (its first ones only when fewer chunks were asked for)
    seconds: float
    tokens_per_s: float  # tokens evaluated (all positions of every chunk) per second, model only
    chunk_ppl: list[float] = field(default_factory=list)  # running PPL after each chunk
    kl: KLResult | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ============================================================================ driver
def prepare_chunks(model, text: str | None, n_ctx: int, n_chunks: int | None) -> tuple[np.ndarray, int]:
    """(chunks int64 (n, n_ctx), number of tokens in the text) for `model`'s tokenizer."""
    if n_ctx > model.n_ctx:
        raise InvalidArgumentError(f"-c {n_ctx} is larger than the model's loaded context ({model.n_ctx})")
    tok = model.tokenizer
    # only the text's first tokens when fewer chunks than the text holds are asked for (the same
    # ids as the whole text's first ones; a 465 K-character text takes seconds to tokenize)
    enough = max(n_chunks, 2) * n_ctx if n_chunks is not None and n_chunks > 0 else None
    tokens = tok.tokenize(default_text() if text is None else text, add_special=True, parse_special=False,
                          stop_after=enough)
    return make_chunks(tokens, n_ctx, n_chunks, tok.bos_id if tok.add_bos else None), len(tokens)


def scored_logits(model, chunk: np.ndarray) -> np.ndarray:
    """float32 (n_ctx/2 - 1, V): the logits of a fresh run over `chunk` at the scored positions."""
    n_ctx = len(chunk)
    return model.logits(chunk, first=n_ctx // 2)[: n_ctx - 1 - n_ctx // 2]


def score(model, chunks: np.ndarray, base: Callable[[int, np.ndarray], BaseLogProbs] | None = None,
          progress: Callable[[int, int, float], None] | None = None, n_text_tokens: int = 0,
          on_logits: Callable[[int, np.ndarray], None] | None = None) -> PerplexityResult:
    """Run `model` over every chunk; `base(i, chunk)` gives the base's stored log-probs for KL;
    `on_logits(i, logits)` sees each chunk's scored logits (quality keeps the base's from them)."""
    n_chunks, n_ctx = chunks.shape
    first = n_ctx // 2
    threads = getattr(model, "threads", 1)  # the log-softmax rows run on the model's threads too
    nlls, acc, chunk_ppl = [], [], []
    t_model = 0.0
    t0 = time.perf_counter()
    for i, chunk in enumerate(chunks):
        targets = chunk[first + 1 :]
        t1 = time.perf_counter()
        logits = scored_logits(model, chunk)
        t_model += time.perf_counter() - t1
        if on_logits is not None:
            on_logits(i, logits)
        if base is not None:
            rows = kl_rows(logits, targets, base(i, chunk), threads)
            acc.append(rows)
            nlls.append(rows["nll"].astype(np.float64))
        else:
            nlls.append(nll_rows(logits, targets, threads))
        all_nll = np.concatenate(nlls)
        chunk_ppl.append(float(np.exp(all_nll.sum() / len(all_nll))))
        if progress is not None:
            progress(i + 1, n_chunks, chunk_ppl[-1])
    nll = np.concatenate(nlls)
    count = len(nll)
    mean = nll.sum() / count
    var = (nll * nll).sum() / count - mean * mean
    ppl = float(np.exp(mean))
    err = float(np.sqrt(var / (count - 1)) * ppl) if var > 0 and count > 1 else 0.0
    kl = kl_summary({k: np.concatenate([a[k] for a in acc]) for k in acc[0]}) if acc else None
    return PerplexityResult(ppl, err, n_ctx, n_chunks, count, n_text_tokens, time.perf_counter() - t0,
                            n_chunks * n_ctx / max(t_model, 1e-9), chunk_ppl, kl)


def perplexity(model, text: str | None = None, *, n_ctx: int = 512, n_chunks: int | None = None, base=None,
               progress: Callable[[int, int, float], None] | None = None) -> PerplexityResult:
    """Perplexity of loaded `model` (edgellm.Model) over `text` (default: default_text()); with
    `base` (another Model, same vocabulary) also the KL statistics against it."""
    if base is not None and base.n_vocab != model.n_vocab:
        raise InvalidArgumentError(f"the base model's vocabulary ({base.n_vocab}) differs from the model's "
                                   f"({model.n_vocab}); KL needs the same tokenizer")
    chunks, n_text = prepare_chunks(model, text, n_ctx, n_chunks)
    base_fn = None if base is None else (
        lambda i, chunk: BaseLogProbs.from_logits(scored_logits(base, chunk), base.threads))
    return score(model, chunks, base_fn, progress, n_text)
