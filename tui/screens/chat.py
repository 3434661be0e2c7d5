"""The chat: conversation column (log + prompt) on the left, the stats panel on the right.

Every conversation is kept in the chat store (see store.py) when the app has one: the chat is
created with its first question and saved after each question and each answer; ctrl+o lists the
kept chats. A store that fails turns history off with a notice; the chat goes on.

Generation runs in a thread worker that iterates `Model.chat`, posts each chunk with a copy of
`Model.stats`, and checks for cancellation between chunks. Esc cancels it and keeps the partial
answer; the worker then closes the generator, which is how the model learns to stop.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from dataclasses import asdict, fields

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Header, Input
from textual.worker import Worker, get_current_worker

from edgellm.errors import ContextFullError, EdgeLLMError
from edgellm.tui.messages import GenerationFinished, TokenStreamed
from edgellm.tui.screens.chats import ChatListScreen
from edgellm.tui.screens.settings import SettingsScreen
from edgellm.tui.session import ChatSession, ChatSettings
from edgellm.tui.store import ChatStore, ChatStoreError, title_of
from edgellm.tui.widgets.chat import AssistantMessage, ChatLog, Notice, UserMessage
from edgellm.tui.widgets.stats_panel import StatsPanel, model_title

PANEL_REFRESH_S = 0.25      # 4 panel refreshes a second (RSS, bars, figures)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+o", "chats", "Chats"),
        Binding("f2", "settings", "Settings"),
    ]

    def __init__(self, model, settings: ChatSettings, store: ChatStore | None = None,
                 store_error: str | None = None, resume: bool = False) -> None:
        super().__init__()
        # The screen's own sub-title: changing the app's would also poke the Header of the loading
        # screen being removed, whose title widget may already be gone.
        self.sub_title = model_title(model)  # escaped; the Header shows it without markup parsing
        self.model = model
        self.settings = settings
        self.session = ChatSession()
        self.store = store              # None: history off
        self.store_error = store_error  # why it is off, shown once the screen is up
        self.resume = resume            # open the last kept chat on mount
        self.chat_id: int | None = None  # the kept chat shown (None until its first question)
        self.generation_id = 0          # id of the request whose messages are shown
        self.generating = False         # chunks of the current request are still accepted
        self.busy = False               # from a question until its answer is rendered and noted
        self.answer: AssistantMessage | None = None
        self.worker: Worker | None = None
        self.latest_stats = copy.deepcopy(model.stats)
        # One generation at a time touches the model: a stopped worker may still be inside
        # `next()` when the next request starts; the new worker waits for it here.
        self._model_lock = threading.Lock()
        # Ending an answer and clearing the chat both await widget updates; they take turns.
        self._log_lock = asyncio.Lock()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield ChatLog(id="chat-log")
                yield Input(placeholder="Ask something…  (enter sends)", id="prompt")
            yield StatsPanel(id="stats-panel")
        yield Footer()

    async def on_mount(self) -> None:
        panel = self.query_one(StatsPanel)
        panel.set_model(self.model)
        panel.show_stats(self.latest_stats)
        self.set_interval(PANEL_REFRESH_S, self.refresh_panel)
        self.query_one("#prompt", Input).focus()
        if self.store_error:
            await self.query_one(ChatLog).add(Notice(self.store_error, "error"))
        if self.resume and self.store is not None:
            try:
                last = self.store.last()
            except ChatStoreError as exc:
                await self.history_off(exc)
                return
            if last is not None:
                await self.open_kept_chat(last)

    def refresh_panel(self) -> None:
        if self.is_attached:
            self.query_one(StatsPanel).show_stats(self.latest_stats)

    # --- asking ---------------------------------------------------------------------------------
    async def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.busy:
            self.notify("Still answering: press Esc to stop it first.", severity="warning")
            return
        event.input.clear()
        self.busy = True
        self.session.add_user(text)
        await self.keep()
        log = self.query_one(ChatLog)
        await log.add(UserMessage(text))
        self.answer = AssistantMessage()
        await log.add(self.answer)
        self.generation_id += 1
        self.generating = True
        self.worker = self.generate(
            self.generation_id, self.session.messages(self.settings.system_prompt), self.settings.sampling()
        )

    @work(thread=True, exclusive=True, group="generate", exit_on_error=False)
    def generate(self, generation_id: int, messages: list[dict], sampling: dict) -> None:
        worker = get_current_worker()
        reason, error = "done", None
        with self._model_lock:
            if worker.is_cancelled:
                return
            stream = None
            try:
                stream = self.model.chat(messages, **sampling)
                n_chunks, finish_reason = 0, None
                for chunk in stream:
                    n_chunks += 1
                    finish_reason = getattr(chunk, "finish_reason", None)
                    self.post_message(TokenStreamed(generation_id, chunk.text, copy.deepcopy(self.model.stats)))
                    if worker.is_cancelled:
                        reason = "stopped"
                        break
                if finish_reason == "length" and n_chunks < sampling["max_tokens"]:
                    # cut short before max_tokens: the answer filled the context
                    reason = "context_full"
                    error = f"the answer filled all {self.model.n_ctx} tokens of the context and was cut short."
            except ContextFullError as exc:
                reason, error = "context_full", str(exc)
            except EdgeLLMError as exc:
                reason, error = "error", str(exc)
            except Exception as exc:  # a bug in the engine must not take the terminal down with it
                reason, error = "error", f"{type(exc).__name__}: {exc}"
            finally:
                if stream is not None and hasattr(stream, "close"):
                    stream.close()      # a generator stops the model where it is
            stats = copy.deepcopy(self.model.stats)
        self.post_message(GenerationFinished(generation_id, reason, error, stats))

    def _is_current(self, message: TokenStreamed | GenerationFinished) -> bool:
        """False for the tail of a stopped generation, and while the app is quitting (the worker
        then reports "stopped" to a screen that is already detached: nothing may be mounted)."""
        return message.generation_id == self.generation_id and self.generating and self.is_attached

    def on_token_streamed(self, message: TokenStreamed) -> None:
        if not self._is_current(message):
            return
        self.answer.feed(message.text)
        self.latest_stats = message.stats
        self.query_one(StatsPanel).record_token(message.stats)

    async def on_generation_finished(self, message: GenerationFinished) -> None:
        if not self._is_current(message):
            return
        self.latest_stats = message.stats
        await self.end_answer(message.reason, message.error)

    async def end_answer(self, reason: str, error: str | None) -> None:
        """Stop accepting chunks, then keep what was generated (also when stopped) and say why the
        answer ended. Questions wait (`busy`) until this is done, so turns stay in order."""
        self.generating = False
        async with self._log_lock:
            await self._note_answer(self.answer, reason, error)
        self.busy = False

    async def _note_answer(self, answer: AssistantMessage, reason: str, error: str | None) -> None:
        log = self.query_one(ChatLog)
        if answer.text:
            self.session.add_assistant(answer.text)
        else:
            # No answer to pair it with: forget the question so the next one is sent alone.
            self.session.drop_last_user()
        notice = None
        if reason == "stopped":
            notice = Notice("Stopped.", "stopped")
        elif reason == "context_full":
            notice = Notice(f"Context full: {error}\nPress ctrl+n to start a new chat.", "context-full")
        elif reason == "error":
            notice = Notice(f"Error: {error}", "error")
        if answer.text:
            await answer.finish()
        else:
            await answer.remove()
        if notice is not None:
            await log.add(notice)
        await self.keep()
        self.refresh_panel()

    # --- kept chats -----------------------------------------------------------------------------
    async def keep(self) -> None:
        """Save the conversation as it is now (creating the kept chat with its first question)."""
        if self.store is None or not self.session.turns:
            return
        try:
            if self.chat_id is None:
                self.chat_id = self.store.create(title_of(self.session.turns[0]["content"]), self.sub_title,
                                                 asdict(self.settings))
            self.store.save(self.chat_id, self.session.turns, asdict(self.settings))
        except ChatStoreError as exc:
            await self.history_off(exc)

    async def history_off(self, exc: ChatStoreError) -> None:
        self.store = None
        self.notify(str(exc), severity="warning", timeout=10)
        await self.query_one(ChatLog).add(Notice(str(exc), "error"))

    async def open_kept_chat(self, chat_id: int) -> None:
        """Show a kept chat: its messages and its settings; the next question continues it."""
        try:
            chat = self.store.load(chat_id)
        except ChatStoreError as exc:
            self.notify(str(exc), severity="warning")
            return
        await self.action_new_chat()
        names = {f.name for f in fields(ChatSettings)}
        try:
            self.settings = ChatSettings(**{k: v for k, v in chat.settings.items() if k in names})
        except EdgeLLMError:
            pass  # settings from another version that no longer validate: keep the current ones
        self.chat_id = chat.id
        self.session.turns = [dict(t) for t in chat.turns]
        log = self.query_one(ChatLog)
        async with self._log_lock:
            for turn in chat.turns:
                if turn["role"] == "user":
                    await log.add(UserMessage(turn["content"]))
                else:
                    answer = AssistantMessage()
                    await log.add(answer)
                    answer.feed(turn["content"])
                    await answer.finish()

    def action_chats(self) -> None:
        if self.store is None:
            self.notify("Chat history is off.", severity="warning")
            return
        screen = ChatListScreen(self.store, self.chat_id)

        async def chosen(result: tuple | None) -> None:
            if self.chat_id in screen.deleted:
                await self.action_new_chat()
            if result is None:
                return
            if result[0] == "open":
                await self.open_kept_chat(result[1])
            else:
                await self.action_new_chat()

        self.app.push_screen(screen, chosen)

    # --- key actions ----------------------------------------------------------------------------
    async def action_stop(self) -> None:
        if not self.generating:
            return
        self.worker.cancel()
        await self.end_answer("stopped", None)

    async def action_new_chat(self) -> None:
        if self.generating:
            self.worker.cancel()
            self.generating = self.busy = False
        self.generation_id += 1         # whatever the old worker still posts is now stale
        async with self._log_lock:
            self.answer = None
            self.chat_id = None
            self.session.clear()
            await self.query_one(ChatLog).clear()
            self.query_one(StatsPanel).clear_history()
        self.query_one("#prompt", Input).focus()

    def action_settings(self) -> None:
        def apply(settings: ChatSettings | None) -> None:
            if settings is not None:
                self.settings = settings
                self.notify("Settings saved; they apply from the next answer.")

        self.app.push_screen(SettingsScreen(self.settings), apply)
