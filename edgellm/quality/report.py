"""`edgellm.quality.report.quality(base, types)`: what each quant type costs, side by side.

For each type: quantize the base file into a temporary folder, load it, run the perplexity protocol
on the same chunks as the base (KL against the base's stored log-probabilities, computed once and
kept in memory-mapped files), time a short prompt and a few decode steps, and read the memory
ledger. The "knee" is the smallest file whose mean KL is within the budget.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from edgellm.errors import InvalidArgumentError
from edgellm.quality import recipe

DEFAULT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
PROMPT_TOKENS = 64  # the prompt whose time to first token is reported
DECODE_TOKENS = 16  # decode steps timed for tg


@dataclass
class TypeReport:
    type: str
    file_bytes: int
    bits_per_weight: float
    ppl: float
    ppl_err: float
    kl_mean: float
    kl_err: float
    kl_p99: float
    same_top: float
    memory_bytes: int  # the ledger's CPU weights + KV cache
    pp_tps: float  # tokens/s of the scoring runs (n_ctx-token prompts, all logits)
    tg_tps: float
    ttft_s: float  # a PROMPT_TOKENS-token prompt
    quantize_s: float


@dataclass
class QualityReport:
    base: str
    base_type: str
    n_ctx: int
    n_chunks: int
    max_kl: float
    rows: list[TypeReport] = field(default_factory=list)  # sorted by file size, base last
    knee: str | None = None  # smallest type with kl_mean <= max_kl

    def to_dict(self) -> dict:
        return asdict(self)


def _speed(model, chunk: np.ndarray) -> tuple[float, float]:
    """(time to first token of a PROMPT_TOKENS prompt in s, decode tokens/s)."""
    model.reset()
    t0 = time.perf_counter()
    model.eval(chunk[:PROMPT_TOKENS])
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    for tok in chunk[PROMPT_TOKENS : PROMPT_TOKENS + DECODE_TOKENS]:
        model.eval([int(tok)])
    tg = DECODE_TOKENS / (time.perf_counter() - t0)
    model.reset()
    return ttft, tg


def _measure(model, name: str, path: Path, bpw: float, chunks, base_fn, quantize_s: float,
             on_logits=None) -> TypeReport:
    from edgellm.quality.perplexity import score

    r = score(model, chunks, base_fn, on_logits=on_logits)
    _speed(model, chunks[0])  # the first decode steps may still load kernels
    ttft, tg = _speed(model, chunks[0])
    cpu = model.memory().get("cpu", {})
    kl = r.kl
    return TypeReport(name, path.stat().st_size, round(bpw, 3), r.ppl, r.ppl_err,
                      kl.mean if kl else 0.0, kl.mean_err if kl else 0.0, kl.p99 if kl else 0.0,
                      kl.same_top if kl else 1.0, cpu.get("weights", 0) + cpu.get("kv_cache", 0),
                      r.tokens_per_s, tg, ttft, quantize_s)


def quality(base: str | Path, types=DEFAULT_TYPES, *, text: str | None = None, n_ctx: int = 512,
            n_chunks: int | None = 4, threads: int | None = None, max_kl: float = 0.01,
            allow_requantize: bool = False, progress: Callable[[str], None] | None = None) -> QualityReport:
    import edgellm
    from edgellm.gguf_file import GGUFFile
    from edgellm.quality.perplexity import BaseLogProbs, prepare_chunks

    say = progress or (lambda msg: None)
    types = [recipe.parse_type(t) for t in types]
    if not types:
        raise InvalidArgumentError("--types is empty; name at least one type, e.g. Q8_0,Q4_K_M")
    if n_ctx < 2 * PROMPT_TOKENS:
        raise InvalidArgumentError(f"-c {n_ctx}: quality needs at least {2 * PROMPT_TOKENS} tokens per chunk")
    base = Path(base)
    gf = GGUFFile(base)
    n_params = sum(t.n_elements for t in gf.tensors.values())
    base_bpw = 8.0 * sum(t.nbytes for t in gf.tensors.values()) / max(n_params, 1)
    ft = gf.metadata.get("general.file_type")
    base_type = next((k for k, (code, _) in recipe.FILE_TYPES.items() if code == ft), f"file_type {ft}")
    gf.close()

    work = Path(tempfile.mkdtemp(prefix="edgellm-quality-"))
    try:
        say(f"base {base.name}: scoring")
        bm = edgellm.load(base, n_ctx=n_ctx, threads=threads)
        chunks, _ = prepare_chunks(bm, text, n_ctx, n_chunks)
        stored = []  # per chunk: the base's 16-bit log-probs, on disk

        def keep(i: int, logits: np.ndarray) -> None:  # from the base's own scoring run: one pass
            b = BaseLogProbs.from_logits(logits, bm.threads)
            q = np.lib.format.open_memmap(work / f"base{i}.npy", mode="w+", dtype=np.uint16, shape=b.q.shape)
            q[:] = b.q
            q.flush()
            stored.append(BaseLogProbs(b.scale, b.min_log_prob, q))

        rows = [_measure(bm, f"{base_type} (base)", base, base_bpw, chunks, None, 0.0, on_logits=keep)]
        base_fn = lambda i, chunk: stored[i]  # noqa: E731
        del bm
        for t in types:
            say(f"{t}: quantizing")
            t0 = time.perf_counter()
            res = edgellm.quantize(base, work / f"{t}.gguf", t, allow_requantize=allow_requantize, threads=threads)
            qs = time.perf_counter() - t0
            say(f"{t}: scoring")
            m = edgellm.load(res.path, n_ctx=n_ctx, threads=threads)
            rows.append(_measure(m, t, res.path, res.bits_per_weight, chunks, base_fn, qs))
            del m
            (work / f"{t}.gguf").unlink()
            r = rows[-1]
            say(f"{t}: PPL {r.ppl:.4f}, KL {r.kl_mean:.5f}, same top {100 * r.same_top:.2f} %")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    quantized = sorted(rows[1:], key=lambda r: r.file_bytes)
    within = [r for r in quantized if r.kl_mean <= max_kl]
    return QualityReport(str(base), base_type, n_ctx, len(chunks), max_kl, quantized + rows[:1],
                         within[0].type if within else None)


# ============================================================================ presentation
def table(rep: QualityReport) -> str:
    from edgellm.memory import format_size

    head = (f"{'type':<14} {'size':>10} {'bpw':>6} {'memory':>10} {'PPL':>16} {'mean KL':>17} {'p99 KL':>8} "
            f"{'top-1':>7} {'pp t/s':>7} {'tg t/s':>7} {'ttft':>7}")
    lines = [head, "-" * len(head)]
    for r in rep.rows:
        mark = "  <- knee" if r.type == rep.knee else ""
        lines.append(f"{r.type:<14} {format_size(r.file_bytes):>10} {r.bits_per_weight:6.2f} "
                     f"{format_size(r.memory_bytes):>10} {r.ppl:8.4f} ±{r.ppl_err:6.4f} "
                     f"{r.kl_mean:8.5f} ±{r.kl_err:7.5f} {r.kl_p99:8.4f} {100 * r.same_top:6.2f}% "
                     f"{r.pp_tps:7.1f} {r.tg_tps:7.1f} {r.ttft_s:6.2f}s{mark}")
    knee = (f"knee (smallest type with mean KL <= {rep.max_kl:g}): {rep.knee}" if rep.knee
            else f"no type is within mean KL <= {rep.max_kl:g}")
    lines += ["", f"{rep.n_chunks} chunks of {rep.n_ctx} tokens; KL against {Path(rep.base).name}; {knee}"]
    return "\n".join(lines)


def chart(rep: QualityReport, width: int = 50) -> str:
    """Size (bar length) against mean KL (log scale, in the label), one line per type."""
    rows = [r for r in rep.rows if not r.type.endswith("(base)")]
    if not rows:
        return ""
    biggest = max(r.file_bytes for r in rep.rows)
    lines = ["size (bar) and mean KL vs base:"]
    for r in rows:
        bar = "#" * max(1, round(width * r.file_bytes / biggest))
        lines.append(f"{r.type:<8} {bar:<{width}} KL {r.kl_mean:.2e}")
    return "\n".join(lines)


def plot(rep: QualityReport, path: str | Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgumentError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                                   "(or drop --plot; the table and the terminal chart need nothing)") from None
    rows = [r for r in rep.rows if not r.type.endswith("(base)")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r.file_bytes / 2**20 for r in rows]
    ys = [max(r.kl_mean, 1e-6) for r in rows]
    ax.plot(xs, ys, "o-")
    for r, x, y in zip(rows, xs, ys):
        ax.annotate(r.type, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(rep.max_kl, color="gray", linestyle="--", linewidth=0.8, label=f"KL budget {rep.max_kl:g}")
    ax.set_yscale("log")
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("mean KL divergence vs base")
    ax.set_title(Path(rep.base).name)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
