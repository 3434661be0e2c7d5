"""The list of kept chats (ctrl+o): open, new, rename, delete, export to Markdown.

Dismisses with ("open", chat_id), ("new", None), or None (closed); rename, delete and export act on
the store at once. `deleted` holds the ids deleted while the list was open, so the chat screen can
forget its current chat if it was one of them.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option

from edgellm.tui.store import ChatStore, ChatStoreError


def export_name(chat_id: int, title: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "chat"
    return f"edgellm-chat-{chat_id}-{slug}.md"


class ChatListScreen(ModalScreen[tuple | None]):
    BINDINGS = [
        Binding("escape", "close", "Close"),
        Binding("n", "new", "New"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("e", "export", "Export .md"),
    ]

    def __init__(self, store: ChatStore, current: int | None = None, export_dir: Path | None = None) -> None:
        super().__init__()
        self.store = store
        self.current = current
        self.export_dir = export_dir
        self.deleted: set[int] = set()
        self.renaming: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-dialog"):
            yield Static("Chats  (enter opens · n new · r rename · d delete · e export · esc closes)",
                         classes="dialog-title")
            yield OptionList(id="chat-list")
            yield Input(placeholder="New title (enter saves, esc cancels)", id="rename")
            yield Static("", id="chats-status", markup=False)

    def on_mount(self) -> None:
        self.query_one("#rename", Input).display = False
        self.reload()
        self.query_one(OptionList).focus()

    def reload(self) -> None:
        listing = self.query_one(OptionList)
        highlighted = self.selected()
        listing.clear_options()
        try:
            chats = self.store.chats()
        except ChatStoreError as exc:
            self.status(str(exc))
            return
        for c in chats:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            mark = "▸ " if c.id == self.current else "  "
            listing.add_option(Option(f"{mark}{c.title}   · {c.n_messages} messages · {c.model} · {when}",
                                      id=str(c.id)))
        if chats:
            ids = [c.id for c in chats]
            listing.highlighted = ids.index(highlighted) if highlighted in ids else 0
        else:
            self.status("No chats yet: ask something and it is kept here.")

    def selected(self) -> int | None:
        listing = self.query_one(OptionList)
        if listing.highlighted is None or listing.option_count == 0:
            return None
        return int(listing.get_option_at_index(listing.highlighted).id)

    def status(self, text: str) -> None:
        self.query_one("#chats-status", Static).update(text)

    # --- actions ------------------------------------------------------------------------------
    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(("open", int(event.option.id)))

    def action_new(self) -> None:
        if self.renaming is None:
            self.dismiss(("new", None))

    def action_close(self) -> None:
        if self.renaming is not None:
            self._end_rename()
        else:
            self.dismiss(None)

    def action_rename(self) -> None:
        chat_id = self.selected()
        if chat_id is None or self.renaming is not None:
            return
        try:
            title = self.store.load(chat_id).title
        except ChatStoreError as exc:
            self.status(str(exc))
            return
        self.renaming = chat_id
        box = self.query_one("#rename", Input)
        box.value = title
        box.display = True
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        title = " ".join(event.value.split())
        if title and self.renaming is not None:
            self._act(lambda: self.store.rename(self.renaming, title), f"Renamed to “{title}”.")
        self._end_rename()
        self.reload()

    def _end_rename(self) -> None:
        self.renaming = None
        box = self.query_one("#rename", Input)
        box.display = False
        self.query_one(OptionList).focus()

    def action_delete(self) -> None:
        chat_id = self.selected()
        if chat_id is None or self.renaming is not None:
            return
        if self._act(lambda: self.store.delete(chat_id), "Chat deleted."):
            self.deleted.add(chat_id)
        self.reload()

    def action_export(self) -> None:
        chat_id = self.selected()
        if chat_id is None or self.renaming is not None:
            return
        folder = self.export_dir or Path.cwd()

        def export():
            chat = self.store.load(chat_id)
            target = folder / export_name(chat_id, chat.title)
            target.write_text(self.store.markdown(chat_id), encoding="utf-8")
            return target

        try:
            target = export()
        except (ChatStoreError, OSError) as exc:
            self.status(f"Export failed: {exc}")
            return
        self.status(f"Exported to {target}")

    def _act(self, fn, done: str) -> bool:
        try:
            fn()
        except ChatStoreError as exc:
            self.status(str(exc))
            return False
        self.status(done)
        return True
