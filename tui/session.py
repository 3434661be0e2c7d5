"""The conversation and the sampling settings of one chat, free of any UI code.

The app keeps one `ChatSession`; every request sends the whole conversation (system prompt first) to
`Model.chat`, which renders it with the model's chat template.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from edgellm.errors import InvalidArgumentError
from edgellm import sampling
from edgellm.sampling import SamplingParams


@dataclass
class ChatSettings:
    """What the settings screen edits (system prompt, temperature, top-p, max tokens) plus the
    sampling flags the command line passes through unchanged."""

    system_prompt: str = ""
    temperature: float = sampling.TEMPERATURE
    top_p: float = sampling.TOP_P
    max_tokens: int = sampling.CHAT_MAX_TOKENS
    top_k: int = sampling.TOP_K
    min_p: float = sampling.MIN_P
    repeat_penalty: float = sampling.REPEAT_PENALTY
    seed: int | None = None

    def __post_init__(self) -> None:
        # the sampling values are checked where generation checks them, with the same messages
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                       repeat_penalty=self.repeat_penalty, seed=self.seed)
        if self.max_tokens < 1:
            raise InvalidArgumentError(f"max tokens must be >= 1, got {self.max_tokens}")

    def sampling(self) -> dict:
        """Keyword arguments for `Model.chat` (everything except the system prompt)."""
        kwargs = asdict(self)
        del kwargs["system_prompt"]
        return kwargs


@dataclass
class ChatSession:
    """The turns of one conversation: [{"role": "user" | "assistant", "content": str}, ...]."""

    turns: list[dict] = field(default_factory=list)

    def messages(self, system_prompt: str) -> list[dict]:
        """The request for `Model.chat`: the system prompt (if any) and then every turn."""
        system = [{"role": "system", "content": system_prompt}] if system_prompt.strip() else []
        return system + [dict(turn) for turn in self.turns]

    def add_user(self, text: str) -> None:
        self.turns.append({"role": "user", "content": text})

    def add_assistant(self, text: str) -> None:
        self.turns.append({"role": "assistant", "content": text})

    def drop_last_user(self) -> None:
        """Forget a question that got no answer (the context was full), so the next one can fit."""
        if self.turns and self.turns[-1]["role"] == "user":
            self.turns.pop()

    def clear(self) -> None:
        self.turns.clear()
