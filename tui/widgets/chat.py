"""The conversation column: user turns, streamed Markdown answers, notices."""
from __future__ import annotations

import asyncio

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widget import Widget
from textual.widgets import Markdown, Static

# Markdown re-layout is the expensive part of streaming, and its cost grows with the number of
# blocks (paragraphs, list items, code fences) already shown. So chunks are buffered and appended
# every FLUSH_BASE_S seconds, stretched by one FLUSH_BASE_S per FLUSH_BLOCKS_PER_STEP blocks (at most
# FLUSH_MAX_S): the UI's share of the CPU stays flat as the answer grows, instead of growing with it.
FLUSH_BASE_S = 0.15
FLUSH_BLOCKS_PER_STEP = 15
FLUSH_MAX_S = 0.75


def flush_interval(n_blocks: int) -> float:
    return min(FLUSH_MAX_S, FLUSH_BASE_S * (1 + n_blocks / FLUSH_BLOCKS_PER_STEP))


class UserMessage(Static):
    """A question as typed (no markup, no Markdown)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False)
        self.text = text


class Notice(Static):
    """A line from the app itself: stopped, context full, errors."""

    def __init__(self, text: str, kind: str = "info") -> None:
        super().__init__(text, markup=False, classes=kind)
        self.text = text


class AssistantMessage(Widget):
    """An answer rendered as Markdown while it streams.

    `feed` only buffers; a timer appends the buffered text to the Markdown widget (see
    flush_interval), one append at a time (Markdown.append is not re-entrant).
    """

    def __init__(self) -> None:
        super().__init__()
        self.text = ""              # the whole answer so far, raw
        self._pending: list[str] = []
        self._append_lock = asyncio.Lock()
        self._flush_timer = None
        self.finished = False

    def compose(self) -> ComposeResult:
        yield Markdown()

    def on_mount(self) -> None:
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self.finished:
            n_blocks = len(self.query_one(Markdown).children)
            self._flush_timer = self.set_timer(flush_interval(n_blocks), self._timed_flush)

    async def _timed_flush(self) -> None:
        await self.flush()
        self._schedule_flush()

    def feed(self, text: str) -> None:
        self.text += text
        self._pending.append(text)

    async def flush(self) -> None:
        """Append whatever arrived since the last flush."""
        async with self._append_lock:
            if not self._pending or self.finished:
                return
            fragment = "".join(self._pending)
            self._pending.clear()
            await self.query_one(Markdown).append(fragment)

    async def finish(self) -> None:
        """The answer is complete (or stopped): stop the timer and parse the whole answer once, so
        blocks that were split across appends (a list, a code fence) render as one."""
        self.finished = True
        if self._flush_timer is not None:
            self._flush_timer.stop()
        async with self._append_lock:
            self._pending.clear()
            await self.query_one(Markdown).update(self.text)

    @property
    def markdown_source(self) -> str:
        return self.query_one(Markdown).source


class ChatLog(VerticalScroll):
    """Scrolls with the newest content while the user has not scrolled up."""

    def on_mount(self) -> None:
        self.anchor()

    async def add(self, widget: Widget) -> Widget:
        await self.mount(widget)
        self.anchor()
        return widget

    async def clear(self) -> None:
        await self.remove_children()
