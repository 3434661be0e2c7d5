"""Kept chats in the UI, driven by Pilot against the fake engine: a chat survives quitting and
reopening, the chat list's actions work, a damaged history file shows a notice and the app still chats."""
from __future__ import annotations

import sys
from pathlib import Path

from textual.widgets import Input, OptionList, Static

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeModel  # noqa: E402
from test_tui import ask_and_wait, run, wait_for  # noqa: E402

from edgellm.tui.app import ChatApp  # noqa: E402
from edgellm.tui.screens.chats import ChatListScreen, export_name  # noqa: E402
from edgellm.tui.session import ChatSettings  # noqa: E402
from edgellm.tui.store import ChatStore  # noqa: E402
from edgellm.tui.widgets.chat import AssistantMessage, ChatLog, Notice, UserMessage  # noqa: E402


def shown(screen) -> list[tuple[str, str]]:
    """The conversation on screen: (role, text) of every message widget in order."""
    out = []
    for w in screen.query_one(ChatLog).children:
        if isinstance(w, UserMessage):
            out.append(("user", w.text))
        elif isinstance(w, AssistantMessage):
            out.append(("assistant", w.text))
    return out


def test_chat_survives_quit_and_resume(tmp_path):
    db = tmp_path / "chats.db"
    first = FakeModel("First answer.", delay_s=0.001)

    async def session_one():
        app = ChatApp(first, ChatSettings(temperature=0.3, system_prompt="Be brief."), history=db)
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: hasattr(app.screen, "session"))
            await ask_and_wait(pilot, "What is a haiku?")
            first.reply = "Second answer."
            await ask_and_wait(pilot, "Write one.")
            return shown(app.screen)

    before = run(session_one())
    assert before == [("user", "What is a haiku?"), ("assistant", "First answer."),
                      ("user", "Write one."), ("assistant", "Second answer.")]

    second = FakeModel("Third answer.", delay_s=0.001)

    async def session_two():
        app = ChatApp(second, ChatSettings(), history=db, resume=True)
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: hasattr(app.screen, "session") and len(shown(app.screen)) == 4,
                           what="the kept chat to show")
            screen = app.screen
            assert shown(screen) == before
            assert screen.settings.temperature == 0.3 and screen.settings.system_prompt == "Be brief."
            await ask_and_wait(pilot, "Another?")
            return screen.chat_id

    chat_id = run(session_two())
    # the first answer of the reopened chat was asked with the whole conversation
    sent = second.calls[0]["messages"]
    assert [m["content"] for m in sent] == ["Be brief.", "What is a haiku?", "First answer.", "Write one.",
                                            "Second answer.", "Another?"]
    stored = ChatStore.open(db)
    assert [c.id for c in stored.chats()] == [chat_id]
    assert [t["content"] for t in stored.load(chat_id).turns][-2:] == ["Another?", "Third answer."]
    assert stored.load(chat_id).title == "What is a haiku?"


def test_chat_list_actions(tmp_path, monkeypatch):
    db = tmp_path / "chats.db"
    store = ChatStore.open(db)
    a = store.create("Alpha", "FakeLM", {"temperature": 0.5})
    store.save(a, [{"role": "user", "content": "alpha question"}, {"role": "assistant", "content": "alpha answer"}])
    b = store.create("Beta", "FakeLM", {})
    store.save(b, [{"role": "user", "content": "beta question"}, {"role": "assistant", "content": "beta answer"}])
    store.close()
    fake = FakeModel("x", delay_s=0.001)

    async def scenario():
        app = ChatApp(fake, ChatSettings(), history=db)
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: hasattr(app.screen, "session"))
            chat = app.screen
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen), what="the chat list")
            listing = app.screen.query_one(OptionList)
            assert listing.option_count == 2 and "Beta" in str(listing.get_option_at_index(0).prompt)
            # rename the newest (Beta)
            await pilot.press("r")
            box = app.screen.query_one("#rename", Input)
            assert box.display and box.value == "Beta"
            box.value = "Beta renamed"
            await box.action_submit()
            await pilot.pause()
            # export it
            await pilot.press("e")
            await pilot.pause()
            status = str(app.screen.query_one("#chats-status", Static).content)
            # delete Alpha (second row)
            listing.highlighted = 1
            await pilot.press("d")
            await pilot.pause()
            assert listing.option_count == 1
            # open the remaining one
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.screen is chat and len(shown(chat)) == 2, what="the chat to open")
            opened = shown(chat)
            current = chat.chat_id
            # n in the list starts a new chat
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatListScreen))
            await pilot.press("n")
            await wait_for(pilot, lambda: app.screen is chat and not shown(chat), what="a new chat")
            return status, opened, current, chat.chat_id

    monkeypatch.chdir(tmp_path)
    status, opened, current, after_new = run(scenario())
    assert opened == [("user", "beta question"), ("assistant", "beta answer")] and current == b
    assert after_new is None
    exported = tmp_path / export_name(b, "Beta renamed")
    assert str(exported) in status
    assert exported.read_text().startswith("# Beta renamed\n") and "beta answer" in exported.read_text()
    store = ChatStore.open(db)
    assert [(c.id, c.title) for c in store.chats()] == [(b, "Beta renamed")]


def test_damaged_history_shows_a_notice_and_chat_goes_on(tmp_path):
    db = tmp_path / "chats.db"
    db.write_bytes(b"garbage, not a database " * 200)
    fake = FakeModel("Still here.", delay_s=0.001)

    async def scenario():
        app = ChatApp(fake, ChatSettings(), history=db)
        async with app.run_test() as pilot:
            await wait_for(pilot, lambda: hasattr(app.screen, "session"))
            screen = app.screen
            await wait_for(pilot, lambda: any(isinstance(w, Notice) for w in screen.query_one(ChatLog).children),
                           what="the notice")
            notice = next(w for w in screen.query_one(ChatLog).children if isinstance(w, Notice))
            answer = await ask_and_wait(pilot, "Hello?")
            await pilot.press("ctrl+o")  # no list, a warning instead
            await pilot.pause()
            return notice.text, answer.text, screen.store, type(app.screen).__name__

    text, answer, store, top = run(scenario())
    assert "chat history is off" in text and "damaged" in text and str(db) in text
    assert answer == "Still here." and store is None and top == "ChatScreen"
    assert db.read_bytes().startswith(b"garbage")  # left as it was for the user to rescue
