"""Chat templates: messages → prompt text, the way Hugging Face's `apply_chat_template` renders them.

A GGUF file carries its template as Jinja source in `tokenizer.chat_template`. That source comes
from whoever made the file, so it is rendered only in jinja2's ImmutableSandboxedEnvironment: a
template can read its inputs but not mutate them, and cannot reach Python internals
(`__class__`, `__globals__`, modules). The environment matches Hugging Face's: trim_blocks and
lstrip_blocks on, the loop-controls extension, a `{% generation %}` block, and the helpers
`raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that keeps non-ASCII text.

A file without a template gets ChatML, as llama.cpp does (`llama_chat_apply_template` falls back
to "chatml"). That includes Gemma-3-270M: it is a base model, never trained on Gemma's
`<start_of_turn>` format, so there is no "right" format to prefer, and using llama.cpp's choice
keeps prompts — and so token ids and logits — comparable with llama.cpp.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgellm.errors import TemplateError

# llama.cpp's "chatml" format: <|im_start|>{role}\n{content}<|im_end|>\n ... <|im_start|>assistant\n
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """raise_exception() called by the template itself (kept apart from jinja's own errors)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}`: marks the assistant's part; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at the first unsafe attribute access (jinja2 would return
    an undefined value that renders as "", hiding the attempt)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")


class ChatTemplate:
    """A chat template compiled once in the sandbox; `render` turns messages into prompt text."""

    def __init__(self, source: str | None) -> None:
        self.source = source if source else CHATML_TEMPLATE
        self.is_fallback = not source
        env = _Sandbox(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"the chat template does not parse (line {exc.lineno}: {exc.message}). Pass a "
                "working template, or none to use ChatML.") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], *, bos_token: str, eos_token: str,
               add_generation_prompt: bool = True, **variables: Any) -> str:
        """Prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        `variables` are passed to the template as well (e.g. tools=[...], documents=[...])."""
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise TemplateError(f"message {i} is {message!r}; each message must be a dict with a "
                                    "string 'role' (and usually a 'content').")
        try:
            return self._template.render(
                messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
                add_generation_prompt=add_generation_prompt, **variables)
        except _TemplateRaised as exc:
            raise TemplateError(f"the chat template rejected the messages: {exc}") from None
        except jinja2.exceptions.SecurityError as exc:
            raise TemplateError(
                f"the chat template tried something the sandbox forbids ({exc}); the template in "
                "this file is unsafe or broken. Pass another template.") from None
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template failed to render: {exc}") from None
        except Exception as exc:  # a template can raise anything Python can (TypeError, ...)
            raise TemplateError(
                f"the chat template failed to render ({type(exc).__name__}: {exc}). Check the "
                "messages' roles and contents against what the template expects.") from None


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str,
                eos_token: str, add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render `messages` with `template` (the file's tokenizer.chat_template; None → ChatML)."""
    return ChatTemplate(template).render(messages, bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt, **variables)
