"""The edgellm chat app and its entry point `run_chat`.

    run_chat(model_or_loader, settings=None, *, history=True, resume=False, **settings_fields) -> int

`model_or_loader` is a loaded `edgellm.Model`, or a callable returning one (e.g.
`lambda: edgellm.load(path, gpu_layers=...)`): the app then opens at once on a loading screen and
calls the loader in a worker, so a slow load never leaves the terminal blank. The app talks to the
model only through the public API (`chat`, `stats`, `plan`, `n_ctx`, `metadata`).

history: True keeps every chat in the default store (store.default_path()), a path keeps them
there, False / None keeps nothing; resume opens the last kept chat.
"""
from __future__ import annotations

from typing import Any, Callable

from textual import work
from textual.app import App
from textual.binding import Binding

from edgellm.errors import InvalidArgumentError
from edgellm.tui.messages import ModelLoaded, ModelLoadFailed
from edgellm.tui.screens.chat import ChatScreen
from edgellm.tui.screens.loading import LoadingScreen
from edgellm.tui.session import ChatSettings
from edgellm.tui.store import ChatStore, ChatStoreError


class ChatApp(App):
    CSS_PATH = "app.tcss"
    TITLE = "edgellm"
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]     # Textual's default, shown

    def __init__(self, model_or_loader: Any | Callable[[], Any], settings: ChatSettings | None = None, *,
                 history=None, resume: bool = False) -> None:
        super().__init__()
        self.history = history
        self.resume = resume
        if hasattr(model_or_loader, "chat"):
            self.model, self._loader = model_or_loader, None
        elif callable(model_or_loader):
            self.model, self._loader = None, model_or_loader
        else:
            raise InvalidArgumentError(
                f"run_chat needs a loaded model or a function that loads one, got {type(model_or_loader).__name__}"
            )
        self.settings = settings or ChatSettings()
        self.load_error: BaseException | None = None

    def on_mount(self) -> None:
        if self.model is not None:
            self.open_chat()
        else:
            self.push_screen(LoadingScreen())
            self.load_model()

    @work(thread=True, group="load", exit_on_error=False)
    def load_model(self) -> None:
        try:
            model = self._loader()
        except BaseException as exc:  # reported by run_chat once the terminal is restored
            self.post_message(ModelLoadFailed(exc))
            return
        self.post_message(ModelLoaded(model))

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self.model = message.model
        if self.is_running:         # not when the user quit while the model was loading
            self.open_chat()

    def on_model_load_failed(self, message: ModelLoadFailed) -> None:
        self.load_error = message.error
        self.exit(return_code=1)

    def open_store(self) -> tuple[ChatStore | None, str | None]:
        """(the chat store, None) or (None, why history is off)."""
        if not self.history:
            return None, None
        try:
            return ChatStore.open(None if self.history is True else self.history), None
        except ChatStoreError as exc:
            return None, str(exc)

    def open_chat(self) -> None:
        store, error = self.open_store()
        screen = ChatScreen(self.model, self.settings, store, error, self.resume)
        if isinstance(self.screen, LoadingScreen):
            self.switch_screen(screen)
        else:
            self.push_screen(screen)


def run_chat(model_or_loader: Any | Callable[[], Any], settings: ChatSettings | None = None, *,
             history=True, resume: bool = False, **settings_fields) -> int:
    """Run the chat until the user quits; returns the exit code. A loader's error is re-raised here,
    after the terminal is restored, so the command line reports it like any other error.

    settings_fields: ChatSettings fields (system_prompt, temperature, top_p, max_tokens, top_k,
    min_p, repeat_penalty, seed) when no `settings` is given.
    """
    app = ChatApp(model_or_loader, settings or ChatSettings(**settings_fields), history=history, resume=resume)
    app.run()
    if app.load_error is not None:
        raise app.load_error
    return app.return_code or 0
