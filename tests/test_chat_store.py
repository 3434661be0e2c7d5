"""The chat history file (edgellm.tui.store): round trips, ordering, versioning, and the damaged or
locked file that must turn history off with a clear message."""
from __future__ import annotations

import sqlite3

import pytest

from edgellm.errors import EdgeLLMError
from edgellm.tui.store import SCHEMA_VERSION, ChatStore, ChatStoreError, default_path, title_of

TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! **How** can I help?"},
         {"role": "user", "content": "A haiku, please."}, {"role": "assistant", "content": "Old pond\nfrog"}]


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "edgellm" / "chats.db"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_path() == tmp_path / "home" / ".local" / "share" / "edgellm" / "chats.db"


def test_round_trip_survives_reopening(tmp_path):
    path = tmp_path / "sub" / "chats.db"
    store = ChatStore.open(path)
    a = store.create("first", "SmolLM2", {"temperature": 0.3, "system_prompt": "Be brief."})
    store.save(a, TURNS[:2])
    b = store.create("second", "Gemma", {"temperature": 0.8})
    store.save(b, TURNS[:1], {"temperature": 0.5})
    store.save(a, TURNS)  # a is now the newest
    store.close()

    store = ChatStore.open(path)
    assert [(c.id, c.title, c.n_messages) for c in store.chats()] == [(a, "first", 4), (b, "second", 1)]
    assert store.last() == a
    chat = store.load(a)
    assert chat.turns == TURNS and chat.model == "SmolLM2" and chat.settings["system_prompt"] == "Be brief."
    assert chat.updated >= chat.created
    assert store.load(b).settings == {"temperature": 0.5}
    store.rename(b, "renamed")
    store.delete(a)
    assert [(c.id, c.title) for c in store.chats()] == [(b, "renamed")]
    assert store.last() == b
    with pytest.raises(ChatStoreError, match="no chat"):
        store.load(a)
    # the deleted chat's messages went with it
    assert store.conn.execute("SELECT count(*) FROM messages WHERE chat_id = ?", (a,)).fetchone()[0] == 0
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_markdown_export(tmp_path):
    store = ChatStore.open(tmp_path / "c.db")
    cid = store.create("Poems", "SmolLM2", {"system_prompt": "Be brief."})
    store.save(cid, TURNS)
    md = store.markdown(cid)
    assert md.startswith("# Poems\n")
    assert md.index("**System**") < md.index("Be brief.") < md.index("**You**\n\nHi") \
        < md.index("**Assistant**\n\nHello! **How** can I help?") < md.index("A haiku, please.") < md.index("Old pond\nfrog")


def test_damaged_file_is_a_clear_error(tmp_path):
    path = tmp_path / "chats.db"
    path.write_bytes(b"this is not an SQLite file, just some bytes " * 100)
    with pytest.raises(ChatStoreError) as e:
        ChatStore.open(path)
    assert isinstance(e.value, EdgeLLMError)
    assert "chat history is off" in str(e.value) and "damaged" in str(e.value) and str(path) in str(e.value)


def test_truncated_database_is_a_clear_error(tmp_path):
    path = tmp_path / "chats.db"
    store = ChatStore.open(path)
    cid = store.create("x", "m", {})
    store.save(cid, [{"role": "user", "content": "word " * 5000}])
    store.close()
    data = bytearray(path.read_bytes())
    data[100:4096 * 2] = b"\xff" * (4096 * 2 - 100)  # the schema page and the next one overwritten
    path.write_bytes(bytes(data))
    with pytest.raises(ChatStoreError, match="damaged"):
        ChatStore.open(path)


def test_locked_file_is_a_clear_error(tmp_path, monkeypatch):
    import edgellm.tui.store as store_module

    monkeypatch.setattr(store_module, "LOCK_TIMEOUT_S", 0.1)
    path = tmp_path / "chats.db"
    ChatStore.open(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(ChatStoreError, match="locked by another program"):
            ChatStore.open(path)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    # a lock taken while the app runs fails the write, with the same message
    store = ChatStore.open(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(ChatStoreError, match="locked"):
            store.create("t", "m", {})
    finally:
        holder.execute("ROLLBACK")
    assert store.create("t", "m", {}) == 1  # works again once the lock is gone


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "chats.db"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(ChatStoreError, match="newer edgellm"):
        ChatStore.open(path)


def test_title_of():
    assert title_of("  What is\nthe capital  of France? ") == "What is the capital of France?"
    long = title_of("word " * 30, width=20)
    assert long == "word word word word…" and len(long) <= 21
