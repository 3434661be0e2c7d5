"""The side panel: memory per device, the layer map, ms per token per device with history, and the
speed / context / weight-bandwidth figures of the current (or last) answer."""
from __future__ import annotations

import threading
from collections import deque

import psutil
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Sparkline, Static

from edgellm.errors import printable
from edgellm.tui.widgets.layer_map import LayerMap
from edgellm.tui.widgets.memory_bar import MemoryBar, format_bytes

TIMING_HISTORY = 64     # tokens of ms/token history per device in the sparklines
BW_TOKENS = 16          # tokens the weight-bandwidth figure averages
TIMING_HEADING = "ms / token"
NO_VALUE = "–"
BLANK_FIGURES = {"ttft": f"TTFT {NO_VALUE}", "tpot": f"TPOT {NO_VALUE}", "tps": f"{NO_VALUE} tok/s",
                 "pp": f"pp {NO_VALUE} t/s"}


def model_title(model) -> str:
    """The model's name from its file (`general.name`, else the architecture) as one printable line:
    a name may hold anything (escape sequences, newlines, bidi overrides), so it is escaped as error
    messages are (edgellm.errors.printable) and shown without markup parsing."""
    md = model.metadata
    return printable(md.get("general.name") or md.get("general.architecture") or "model")


def timing_heading(rate: float | None, memory: float | None) -> str:
    """'ms / token  cpu 29 GB/s 88%': the heading of the timings with the weights the CPU read per
    second (the seed's bandwidth utilisation) and their share of the machine's memory read rate
    (the stream test of `edgellm bench`), each once known."""
    if rate is None:
        return TIMING_HEADING
    gbs = rate / 1e9
    text = f"{TIMING_HEADING}  cpu {gbs:.0f} GB/s" if gbs >= 10 else f"{TIMING_HEADING}  cpu {gbs:.1f} GB/s"
    return text + (f" {100 * rate / memory:.0f}%" if memory else "")


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return NO_VALUE if value is None else f"{value:{spec}}{unit}"


def set_text(label: Static, text: str) -> None:
    """Update a one-row label only when its text changes, and without a relayout: every update
    with layout would reflow the whole screen, Markdown answer included, several times a second."""
    if str(label.content) != text:
        label.update(text, layout=False)


class DeviceTiming(Horizontal):
    """One row: device name, its latest ms per token, a sparkline of the last TIMING_HISTORY tokens."""

    def __init__(self, device: str) -> None:
        super().__init__(id=f"timing-{device}", classes="device-timing")
        self.device = device
        self.history: deque[float] = deque(maxlen=TIMING_HISTORY)
        self.drawn = False

    def compose(self) -> ComposeResult:
        yield Static(self.device, classes="timing-label", markup=False)
        yield Sparkline([], classes="timing-spark")

    def on_mount(self) -> None:
        self.show()

    def record(self, ms: float) -> None:
        """Add one token's figure; the panel's refresh tick draws it (per-token redraws would
        repaint the screen at the token rate)."""
        self.history.append(float(ms))
        self.drawn = False

    def show(self) -> None:
        if self.drawn or not self.children:     # nothing new, or not composed yet (on_mount draws)
            return
        latest = self.history[-1] if self.history else None
        set_text(self.query_one(Static), f"{self.device:<8}{_fmt(latest, '6.1f', 'ms')}")
        self.query_one(Sparkline).data = list(self.history)
        self.drawn = True


class StatsPanel(VerticalScroll):
    """Call `set_model` once, `record_token` per streamed chunk (it only records), `show_stats` to
    draw text, bars and sparklines (the chat screen does so 4 times a second), `clear_history` for a
    new chat."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.n_ctx = 0
        self.rss = 0
        self.figures_shown = False      # figures describe an answer: none before the first token
        self._process = psutil.Process()
        self._ram_total = psutil.virtual_memory().total
        self.cpu_read = 0               # bytes of weights a decode step reads on the CPU
        self.memory_bw: float | None = None  # the machine's memory read rate (bytes/s), once measured

    def compose(self) -> ComposeResult:
        yield Static(id="model-name", markup=False)
        yield MemoryBar("RAM", id="ram-bar")
        vram = MemoryBar("VRAM", id="vram-bar")
        vram.display = False
        yield vram
        yield LayerMap(id="layer-map")
        yield Static(TIMING_HEADING, id="timing-heading", classes="heading", markup=False)
        yield Vertical(id="timings")
        with Horizontal(classes="figures"):
            yield Static(BLANK_FIGURES["ttft"], id="ttft")
            yield Static(BLANK_FIGURES["tpot"], id="tpot")
        with Horizontal(classes="figures"):
            yield Static(BLANK_FIGURES["tps"], id="tps")
            yield Static(BLANK_FIGURES["pp"], id="pp")
        yield Static(f"ctx {NO_VALUE}", id="ctx")

    def set_model(self, model) -> None:
        set_text(self.query_one("#model-name", Static), model_title(model))
        self.n_ctx = model.n_ctx
        layer_map = self.query_one(LayerMap)
        layer_map.layers = tuple(model.plan.layers)
        layer_map.experts = tuple(getattr(model.plan, "experts", ()))
        layer_map.output_device = model.plan.output_device
        set_text(self.query_one("#ctx", Static), f"ctx 0 / {self.n_ctx}")
        self.cpu_read = int(model.weights_read_per_token().get("cpu", 0))
        if self.cpu_read:
            threading.Thread(target=self._measure_bandwidth, args=(getattr(model, "threads", 1),),
                             name="edgellm-bandwidth", daemon=True).start()

    def _measure_bandwidth(self, threads: int) -> None:
        """The stream test (a second or so, once per machine: cached in the user cache) off the UI thread."""
        from edgellm.machine import machine_bandwidth

        try:
            self.memory_bw = machine_bandwidth(threads)
        except Exception:  # noqa: BLE001 - no share shown, the rate still is
            self.memory_bw = None

    def cpu_weight_rate(self) -> float | None:
        """Bytes/s of weights the CPU read over the last BW_TOKENS tokens (its bytes per step over
        its ms per token), None before a CPU timing."""
        rows = [row for row in self.query(DeviceTiming) if row.device == "cpu" and row.history]
        if not self.cpu_read or not rows:
            return None
        recent = list(rows[0].history)[-BW_TOKENS:]
        ms = sum(recent) / len(recent)
        return self.cpu_read / (ms / 1000) if ms > 0 else None

    def record_token(self, stats) -> None:
        """Add this token's ms per device to the sparklines (new devices get a row)."""
        self.figures_shown = True
        timings = self.query_one("#timings", Vertical)
        for device, ms in stats.device_ms.items():
            rows = timings.query(f"#timing-{device}")
            if rows:
                rows.first(DeviceTiming).record(ms)
            else:
                row = DeviceTiming(device)
                row.record(ms)
                timings.mount(row)

    def clear_history(self) -> None:
        """A new chat: no timing history, no figures until its first token, empty context."""
        self.query_one("#timings", Vertical).remove_children()
        self.figures_shown = False
        for widget_id, text in BLANK_FIGURES.items():
            set_text(self.query_one(f"#{widget_id}", Static), text)
        set_text(self.query_one("#ctx", Static), f"ctx 0 / {self.n_ctx}")
        set_text(self.query_one("#timing-heading", Static), TIMING_HEADING)

    def show_stats(self, stats) -> None:
        """Refresh bars and figures from a `Model.stats` copy (None before the first answer)."""
        self.rss = self._process.memory_info().rss
        memory = stats.memory if stats is not None else {}
        ram_segments = _ledger_segments(memory.get("cpu", {}))
        self._set_bar("#ram-bar", ram_segments, max(self.rss, sum(ram_segments.values())),
                      f"RAM  rss {format_bytes(self.rss)} / {format_bytes(self._ram_total)}")
        vram = self.query_one("#vram-bar", MemoryBar)
        vram.display = "gpu" in memory
        if "gpu" in memory:
            vram_segments = _ledger_segments(memory["gpu"])
            total = sum(vram_segments.values())
            self._set_bar("#vram-bar", vram_segments, total, f"VRAM {format_bytes(total)}")
        for row in self.query(DeviceTiming):
            row.show()
        if stats is None or not self.figures_shown:
            return
        set_text(self.query_one("#ttft", Static), f"TTFT {_fmt(stats.ttft_s, '.2f', 's')}")
        set_text(self.query_one("#tpot", Static), f"TPOT {_fmt(stats.tpot_ms, '.1f', 'ms')}")
        set_text(self.query_one("#tps", Static), f"{_fmt(stats.gen_tps, '.1f')} tok/s")
        set_text(self.query_one("#pp", Static), f"pp {_fmt(stats.prompt_tps, '.0f')} t/s")
        drafted = getattr(stats, "draft_n", 0)  # speculative decoding: tokens proposed / kept
        spec = f"  draft {stats.draft_n_accepted}/{drafted}" if drafted else ""
        set_text(self.query_one("#ctx", Static), f"ctx {stats.n_past} / {self.n_ctx}{spec}")
        set_text(self.query_one("#timing-heading", Static),
                 timing_heading(self.cpu_weight_rate(), self.memory_bw))

    def _set_bar(self, selector: str, segments: dict[str, int], capacity: int, title: str) -> None:
        bar = self.query_one(selector, MemoryBar)
        if (bar.segments, bar.capacity, bar.title) != (segments, capacity, title):
            bar.segments, bar.capacity, bar.title = segments, capacity, title


def _ledger_segments(terms: dict[str, int]) -> dict[str, int]:
    """Ledger terms of one device → the bar's three segments: weights, KV cache, and every other
    term (activations, runtime, ...) as "other". A process total ("rss") is not a term; a draft
    model's weights and KV cache join the target's."""
    weights = int(terms.get("weights", 0)) + int(terms.get("draft_weights", 0))
    kv = int(terms.get("kv_cache", 0)) + int(terms.get("draft_kv_cache", 0))
    other = sum(int(v) for k, v in terms.items()
                if k not in ("weights", "kv_cache", "draft_weights", "draft_kv_cache", "rss"))
    return {"weights": weights, "kv_cache": kv, "other": other}
