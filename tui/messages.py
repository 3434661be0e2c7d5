"""Messages the generation and loading workers post to the UI (from their threads: `post_message`
is thread-safe). Every generation message carries the id of its request, so the UI can ignore the
tail of a generation it has already stopped."""
from __future__ import annotations

from typing import Any

from textual.message import Message


class ModelLoaded(Message):
    """The loader returned a model; the chat can open."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model


class ModelLoadFailed(Message):
    """The loader raised; the app exits and the command reports the error."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error


class TokenStreamed(Message):
    """One chunk of the answer and a copy of `Model.stats` taken right after it."""

    def __init__(self, generation_id: int, text: str, stats: Any) -> None:
        super().__init__()
        self.generation_id = generation_id
        self.text = text
        self.stats = stats


class GenerationFinished(Message):
    """The worker left the model: reason is "done" (EOS or max tokens), "stopped" (cancelled),
    "context_full" or "error"; error holds the message to show for the last two."""

    def __init__(self, generation_id: int, reason: str, error: str | None, stats: Any) -> None:
        super().__init__()
        self.generation_id = generation_id
        self.reason = reason
        self.error = error
        self.stats = stats
