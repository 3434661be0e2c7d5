"""A stacked memory bar for one device: title line, bar, legend (3 rows).

    RAM  rss 312M / 15.6G
    ████████████████░░░░░░░░░░      weights, KV cache, other in their colours; ░ = rest of capacity
    ■W 92M ■KV 90M ■O 3.0M
"""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

# (key in MemoryBar.segments, legend label, style)
SEGMENT_STYLES = {
    "weights": ("W", "bold dodger_blue1"),
    "kv_cache": ("KV", "bold magenta"),
    "other": ("O", "bold yellow"),
}
REMAINDER_STYLE = "grey37"


def format_bytes(n: float) -> str:
    """Compact size for a narrow panel (1024-based): 512B, 9.5K, 98M, 1.4G."""
    for unit in ("B", "K", "M"):
        if n < 1024:
            return f"{n:.0f}{unit}" if n >= 10 or unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"


def bar_cells(values: list[int], capacity: int, width: int) -> list[int]:
    """Cells per segment so that a segment's share of `width` is its share of `capacity`.

    Rounds the running total (not each segment) so the cells sum to round(total / capacity * width)
    and a non-zero segment never disappears if a cell is left for it.
    """
    if capacity <= 0 or width <= 0:
        return [0] * len(values)
    cells, used, running = [], 0, 0
    for value in values:
        running += value
        end = min(width, round(running / capacity * width))
        n = max(0, end - used)      # an earlier segment may have borrowed this cell
        if value > 0 and n == 0 and used < width:
            n = 1
        cells.append(n)
        used += n
    return cells


class MemoryBar(Widget):
    """Bytes per ledger term on one device. `segments` maps weights / kv_cache / other to bytes;
    `capacity` is what the full bar width stands for; `title` is the first line."""

    DEFAULT_CSS = "MemoryBar { height: 3; }"

    title = reactive("")
    segments: reactive[dict[str, int]] = reactive(dict)
    capacity = reactive(0)

    def __init__(self, title: str = "", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.set_reactive(MemoryBar.title, title)

    def render(self) -> Text:
        width = max(self.size.width, 1)
        keys = list(SEGMENT_STYLES)
        values = [int(self.segments.get(key, 0)) for key in keys]
        cells = bar_cells(values, max(self.capacity, sum(values)), width)
        bar = Text()
        for key, n in zip(keys, cells):
            bar.append("█" * n, SEGMENT_STYLES[key][1])
        bar.append("░" * (width - sum(cells)), REMAINDER_STYLE)
        legend = Text()
        for key, value in zip(keys, values):
            label, style = SEGMENT_STYLES[key]
            legend.append("■", style)
            legend.append(f"{label} {format_bytes(value)} ")
        return Text("\n").join([Text(self.title, style="bold"), bar, legend])
