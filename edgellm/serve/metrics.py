"""GET /metrics: Prometheus text format (version 0.0.4), written by hand — no client library needed.

Gauges and counters of the engine come from `Model.engine_stats()` when scraped; the latency
histograms are observed by the HTTP layer as each request ends.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

PREFIX = "edgellm"
# seconds; chosen like vLLM's, from a fast 135M model on a GPU up to a slow CPU under load
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)

# engine_stats key -> (metric name, type, help)
ENGINE_METRICS = {
    "running": ("requests_running", "gauge", "Sequences being generated (holding a slot)."),
    "waiting": ("requests_waiting", "gauge", "Requests waiting for a slot."),
    "n_seq": ("slots_total", "gauge", "Sequences the engine runs at once (-np)."),
    "kv_blocks_total": ("kv_blocks_total", "gauge", "KV cache blocks in the pool."),
    "kv_blocks_used": ("kv_blocks_used", "gauge", "KV cache blocks held by sequences."),
    "kv_blocks_cached": ("kv_blocks_cached", "gauge", "KV cache blocks no sequence holds, kept for prefix reuse."),
    "kv_blocks_free": ("kv_blocks_free", "gauge", "KV cache blocks neither held nor cached."),
    "preemptions": ("preemptions_total", "counter", "Sequences preempted because the KV pool was full."),
    "prompt_tokens_total": ("prompt_tokens_total", "counter", "Prompt tokens processed."),
    "gen_tokens_total": ("generation_tokens_total", "counter", "Tokens generated."),
    "cached_tokens_total": ("prompt_cached_tokens_total", "counter", "Prompt tokens reused from the KV cache."),
}


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple
    counts: list = field(default_factory=list)  # per bucket (not cumulative), last one +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self) -> list[str]:
        name = f"{PREFIX}_{self.name}"
        out = [f"# HELP {name} {self.help}", f"# TYPE {name} histogram"]
        acc = 0
        for le, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{le}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """What the HTTP layer observes: per-request latencies and outcomes."""

    def __init__(self):
        self.ttft = Histogram("time_to_first_token_seconds", "Time from request to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("time_per_output_token_seconds", "Mean time between tokens of a request.",
                              TPOT_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from request to its last token.", E2E_BUCKETS)
        self.finished: dict[str, int] = {}  # finish reason ("stop", "length", "cancelled", "error") -> count
        self.errors: dict[int, int] = {}  # HTTP status -> count

    def request_done(self, reason: str, t_start: float, t_first: float | None, t_last: float | None,
                     n_tokens: int) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        if t_first is not None:
            self.ttft.observe(t_first - t_start)
            if n_tokens > 1:
                self.tpot.observe((t_last - t_first) / (n_tokens - 1))
        if t_last is not None and reason != "cancelled":
            self.e2e.observe(t_last - t_start)

    def error(self, status: int) -> None:
        self.errors[status] = self.errors.get(status, 0) + 1

    def render(self, engine_stats: dict | None, in_flight: int = 0) -> str:
        name = f"{PREFIX}_http_requests_in_flight"
        out = [f"# HELP {name} Generation requests the server admitted and has not finished.",
               f"# TYPE {name} gauge", f"{name} {in_flight}"]
        for key, (name, kind, help_) in ENGINE_METRICS.items():
            if engine_stats is None or key not in engine_stats:
                continue
            full = f"{PREFIX}_{name}"
            # the text format names a counter's samples with _total; its TYPE line leaves it off
            base = full[: -len("_total")] if kind == "counter" else full
            out += [f"# HELP {base} {help_}", f"# TYPE {base} {kind}", f"{full} {engine_stats[key]}"]
        name = f"{PREFIX}_requests_finished"
        out += [f"# HELP {name} Requests finished, by finish reason.", f"# TYPE {name} counter"]
        out += [f'{name}_total{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())]
        name = f"{PREFIX}_request_errors"
        out += [f"# HELP {name} Requests answered with an error, by HTTP status.", f"# TYPE {name} counter"]
        out += [f'{name}_total{{status="{s}"}} {n}' for s, n in sorted(self.errors.items())]
        for h in (self.ttft, self.tpot, self.e2e):
            out += h.lines()
        return "\n".join(out) + "\n"
