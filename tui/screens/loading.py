"""Shown while the loader runs in a worker (reading the file, planning, preparing the kernels)."""
from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Footer, Header, LoadingIndicator, Static


class LoadingScreen(Screen):
    def __init__(self, what: str = "model") -> None:
        super().__init__()
        self.what = what
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        yield Header()
        with Middle():
            with Center():
                yield Static(f"Loading {self.what}…", id="loading-title", markup=False)
            with Center():
                yield LoadingIndicator(id="loading-indicator")
            with Center():
                yield Static("", id="loading-elapsed")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        elapsed = time.monotonic() - self._started
        self.query_one("#loading-elapsed", Static).update(f"{elapsed:.0f} s  ·  ctrl+q quits")
