"""Kept chats: every conversation of the chat UI in one SQLite file (stdlib sqlite3).

    store = ChatStore.open(path=None)        # None: default_path(); raises ChatStoreError
    chat_id = store.create(title, model, settings)
    store.save(chat_id, turns, settings)     # the whole conversation, in one transaction
    store.chats() -> [ChatSummary, ...]      # newest first
    store.load(chat_id) -> StoredChat        # its turns, model, settings, timestamps
    store.rename(chat_id, title); store.delete(chat_id); store.last() -> id | None
    store.markdown(chat_id) -> str           # the chat as a Markdown document

The file lives in the user data dir: $XDG_DATA_HOME/edgellm/chats.db, else
~/.local/share/edgellm/chats.db (%APPDATA%\\edgellm on Windows). The schema is versioned with
`PRAGMA user_version`; a file written by a newer edgellm, a damaged file, or one another program
holds locked raises ChatStoreError with a message saying what to do, so the app can run with
history off instead of failing.
"""
from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import EdgeLLMError

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id       INTEGER PRIMARY KEY,
    title    TEXT NOT NULL,
    model    TEXT NOT NULL,
    settings TEXT NOT NULL,          -- ChatSettings as JSON
    created  REAL NOT NULL,          -- Unix seconds
    updated  REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    chat_id  INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    seq      INTEGER NOT NULL,       -- 0, 1, ... in conversation order
    role     TEXT NOT NULL,          -- "user" | "assistant"
    content  TEXT NOT NULL,
    created  REAL NOT NULL,
    PRIMARY KEY (chat_id, seq)
);
"""
LOCK_TIMEOUT_S = 1.0  # wait this long for another writer before calling the file locked


class ChatStoreError(EdgeLLMError):
    """The chat history cannot be read or written; the chat works on without it."""


def default_path() -> Path:
    if os.environ.get("XDG_DATA_HOME"):
        base = Path(os.environ["XDG_DATA_HOME"])
    elif sys.platform == "win32" and os.environ.get("APPDATA"):
        base = Path(os.environ["APPDATA"])
    else:
        base = Path.home() / ".local" / "share"
    return base / "edgellm" / "chats.db"


@dataclass(frozen=True)
class ChatSummary:
    id: int
    title: str
    model: str
    created: float
    updated: float
    n_messages: int


@dataclass(frozen=True)
class StoredChat:
    id: int
    title: str
    model: str
    settings: dict
    created: float
    updated: float
    turns: list  # [{"role": ..., "content": ...}, ...]


def _explain(path: Path, exc: Exception) -> ChatStoreError:
    text = str(exc).lower()
    if "locked" in text or "busy" in text:
        why = "it is locked by another program (another edgellm chat?); close that one and reopen"
    elif "not a database" in text or "malformed" in text or "corrupt" in text:
        why = "the file is damaged; move it away (a new one is started) or restore a copy"
    else:
        why = f"{exc}; check the file's permissions and the disk"
    return ChatStoreError(f"chat history is off: {path}: {why}")


class ChatStore:
    def __init__(self, conn: sqlite3.Connection, path: Path):
        self.conn = conn
        self.path = path

    @classmethod
    def open(cls, path: str | os.PathLike | None = None) -> "ChatStore":
        path = Path(path) if path is not None else default_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, timeout=LOCK_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise _explain(path, exc) from None
        try:
            conn.execute("PRAGMA foreign_keys = ON")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ChatStoreError(
                    f"chat history is off: {path} was written by a newer edgellm (schema {version}, this "
                    f"one reads {SCHEMA_VERSION}); upgrade edgellm")
            if version < SCHEMA_VERSION:
                with _transaction(conn):  # version 0: a new file (migrations from 1 on go here)
                    for statement in _SCHEMA.split(";"):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("SELECT count(*) FROM chats").fetchone()  # reads a page: finds damage early
        except ChatStoreError:
            conn.close()
            raise
        except sqlite3.Error as exc:
            conn.close()
            raise _explain(path, exc) from None
        return cls(conn, path)

    def close(self) -> None:
        self.conn.close()

    # --- writing ---------------------------------------------------------------------------
    def create(self, title: str, model: str, settings: dict) -> int:
        now = time.time()
        return self._write(lambda c: c.execute(
            "INSERT INTO chats (title, model, settings, created, updated) VALUES (?, ?, ?, ?, ?)",
            (title, model, json.dumps(settings), now, now)).lastrowid)

    def save(self, chat_id: int, turns: list, settings: dict | None = None) -> None:
        """Store the conversation as it is now (earlier messages keep their timestamps)."""
        now = time.time()

        def write(c):
            kept = {row[0]: row[1] for row in c.execute(
                "SELECT seq, created FROM messages WHERE chat_id = ?", (chat_id,))}
            c.execute("DELETE FROM messages WHERE chat_id = ?", (chat_id,))
            c.executemany("INSERT INTO messages (chat_id, seq, role, content, created) VALUES (?, ?, ?, ?, ?)",
                          [(chat_id, i, t["role"], t["content"], kept.get(i, now)) for i, t in enumerate(turns)])
            if settings is not None:
                c.execute("UPDATE chats SET settings = ? WHERE id = ?", (json.dumps(settings), chat_id))
            c.execute("UPDATE chats SET updated = ? WHERE id = ?", (now, chat_id))

        self._write(write)

    def rename(self, chat_id: int, title: str) -> None:
        self._write(lambda c: c.execute("UPDATE chats SET title = ? WHERE id = ?", (title, chat_id)))

    def delete(self, chat_id: int) -> None:
        self._write(lambda c: c.execute("DELETE FROM chats WHERE id = ?", (chat_id,)))

    def _write(self, fn):
        try:
            with _transaction(self.conn):
                return fn(self.conn)
        except sqlite3.Error as exc:
            raise _explain(self.path, exc) from None

    # --- reading ---------------------------------------------------------------------------
    def chats(self) -> list[ChatSummary]:
        rows = self._read(
            "SELECT c.id, c.title, c.model, c.created, c.updated, count(m.seq) FROM chats c "
            "LEFT JOIN messages m ON m.chat_id = c.id GROUP BY c.id ORDER BY c.updated DESC, c.id DESC")
        return [ChatSummary(*row) for row in rows]

    def last(self) -> int | None:
        rows = self._read("SELECT id FROM chats ORDER BY updated DESC, id DESC LIMIT 1")
        return rows[0][0] if rows else None

    def load(self, chat_id: int) -> StoredChat:
        rows = self._read("SELECT id, title, model, settings, created, updated FROM chats WHERE id = ?", (chat_id,))
        if not rows:
            raise ChatStoreError(f"there is no chat {chat_id} in {self.path} (deleted?)")
        cid, title, model, settings, created, updated = rows[0]
        turns = [{"role": r, "content": c} for r, c in self._read(
            "SELECT role, content FROM messages WHERE chat_id = ? ORDER BY seq", (chat_id,))]
        return StoredChat(cid, title, model, json.loads(settings), created, updated, turns)

    def markdown(self, chat_id: int) -> str:
        chat = self.load(chat_id)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.created))
        lines = [f"# {chat.title}", "", f"*{chat.model}, {when}*", ""]
        system = chat.settings.get("system_prompt")
        if system:
            lines += ["**System**", "", system, ""]
        for turn in chat.turns:
            lines += [f"**{'You' if turn['role'] == 'user' else 'Assistant'}**", "", turn["content"], ""]
        return "\n".join(lines)

    def _read(self, sql: str, args: tuple = ()) -> list[tuple]:
        try:
            return self.conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise _explain(self.path, exc) from None


class _transaction:
    """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) on an autocommit connection."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.conn.execute("COMMIT")
                return False
            except sqlite3.Error:
                self.conn.execute("ROLLBACK")
                raise
        self.conn.execute("ROLLBACK")
        return False


def title_of(text: str, width: int = 48) -> str:
    """A chat's default title: its first question on one line, cut at a word."""
    line = " ".join(text.split())
    if len(line) <= width:
        return line
    cut = line[:width].rsplit(" ", 1)[0] or line[:width]
    return cut + "…"
