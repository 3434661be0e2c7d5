"""Which transformer blocks run where: one cell per block, in order, wrapped to the panel width.

    Layers █gpu12 ▒cpu18 →cpu         (→ the device of the output head)
    ████████████▒▒▒▒▒▒▒▒▒▒▒▒▒▒
    ▒▒▒▒
"""
from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

DEVICE_CELLS = {"gpu": ("█", "bold green"), "cpu": ("▒", "dodger_blue1")}


class LayerMap(Widget):
    """`layers`: the device of every block (Plan.layers); `output_device`: where the head runs."""

    DEFAULT_CSS = "LayerMap { height: auto; }"

    layers: reactive[tuple[str, ...]] = reactive(tuple, layout=True)
    output_device = reactive("cpu")

    def render(self) -> Text:
        width = max(self.size.width, 1)
        header = Text("Layers ", style="bold")
        for device, (glyph, style) in DEVICE_CELLS.items():
            count = sum(1 for d in self.layers if d == device)
            if count:
                header.append(glyph, style)
                header.append(f"{device}{count} ")
        header.append(f"→{self.output_device}")
        cells = Text()
        for i, device in enumerate(self.layers):
            if i and i % width == 0:
                cells.append("\n")
            glyph, style = DEVICE_CELLS.get(device, ("?", "red"))
            cells.append(glyph, style)
        return Text("\n").join([header, cells]) if self.layers else header

    def get_content_height(self, container, viewport, width: int) -> int:
        return 1 + (len(self.layers) + max(width, 1) - 1) // max(width, 1)
