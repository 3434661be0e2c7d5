"""Which transformer blocks run where: one cell per block, in order, wrapped to the panel width.

    Layers █gpu12 ▒cpu18 →cpu         (→ the device of the output head)
    ████████████▒▒▒▒▒▒▒▒▒▒▒▒▒▒
    ▒▒▒▒

A mixture-of-experts block split between the devices (attention on the GPU, experts on the CPU:
--cpu-moe, --n-cpu-moe, -ot) is drawn ▓ and counted as "split".
"""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

DEVICE_CELLS = {"gpu": ("█", "bold green"), "split": ("▓", "yellow"), "cpu": ("▒", "dodger_blue1")}


class LayerMap(Widget):
    """`layers`: the device of every block (Plan.layers); `experts`: the device of its experts
    (Plan.experts, () for a dense model); `output_device`: where the head runs."""

    DEFAULT_CSS = "LayerMap { height: auto; }"

    layers: reactive[tuple[str, ...]] = reactive(tuple, layout=True)
    experts: reactive[tuple[str, ...]] = reactive(tuple)
    output_device = reactive("cpu")

    def cells(self) -> list[str]:
        """Each block's cell: its device, or "split" where its experts are elsewhere."""
        ex = self.experts if len(self.experts) == len(self.layers) else self.layers
        return [d if e == d else "split" for d, e in zip(self.layers, ex)]

    def render(self) -> Text:
        width = max(self.size.width, 1)
        header = Text("Layers ", style="bold")
        kinds = self.cells()
        for device, (glyph, style) in DEVICE_CELLS.items():
            count = kinds.count(device)
            if count:
                header.append(glyph, style)
                header.append(f"{device}{count} ")
        header.append(f"→{self.output_device}")
        cells = Text()
        for i, device in enumerate(kinds):
            if i and i % width == 0:
                cells.append("\n")
            glyph, style = DEVICE_CELLS.get(device, ("?", "red"))
            cells.append(glyph, style)
        return Text("\n").join([header, cells]) if self.layers else header

    def get_content_height(self, container, viewport, width: int) -> int:
        return 1 + (len(self.layers) + max(width, 1) - 1) // max(width, 1)
