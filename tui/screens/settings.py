"""A modal form for the settings a user changes mid-chat: system prompt, temperature, top-p,
max tokens. Dismisses with the new `ChatSettings`, or None when cancelled."""
from __future__ import annotations

from dataclasses import replace

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from edgellm.errors import InvalidArgumentError
from edgellm.tui.session import ChatSettings

# input id -> (label, parser)
FIELDS = {
    "temperature": ("Temperature", float),
    "top_p": ("Top-p", float),
    "max_tokens": ("Max tokens", int),
}


class SettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: ChatSettings) -> None:
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(id="settings-dialog"):
            yield Static("Settings  (enter saves, esc cancels)", classes="dialog-title")
            with Horizontal(classes="field"):
                yield Label("System prompt")
                yield Input(self.settings.system_prompt, placeholder="(none)", id="system_prompt")
            for name, (label, parser) in FIELDS.items():
                with Horizontal(classes="field"):
                    yield Label(label)
                    yield Input(str(getattr(self.settings, name)), id=name,
                                type="integer" if parser is int else "number")
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.save()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.save()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def save(self) -> None:
        try:
            self.dismiss(self.read_form())
        except InvalidArgumentError as exc:
            self.query_one("#settings-error", Static).update(str(exc))

    def read_form(self) -> ChatSettings:
        values: dict = {"system_prompt": self.query_one("#system_prompt", Input).value}
        for name, (label, parser) in FIELDS.items():
            raw = self.query_one(f"#{name}", Input).value.strip()
            try:
                values[name] = parser(raw)
            except ValueError:
                kind = "a whole number" if parser is int else "a number"
                raise InvalidArgumentError(f"{label} must be {kind}, got {raw!r}") from None
        return replace(self.settings, **values)    # replace() re-runs the range checks
