"""Chat templates: messages → prompt text, the way Hugging Face's `apply_chat_template` renders them.

A GGUF file carries its template as Jinja source in `tokenizer.chat_template`. That source comes
from whoever made the file, so it is rendered only in jinja2's ImmutableSandboxedEnvironment: a
template can read its inputs but not mutate them, and cannot reach Python internals
(`__class__`, `__globals__`, modules). The environment matches Hugging Face's: trim_blocks and
lstrip_blocks on, the loop-controls extension, a `{% generation %}` block, and the helpers
`raise_exception(msg)`, `strftime_now(fmt)` and a `tojson` filter that keeps non-ASCII text.

The sandbox keeps a template from reaching Python; `_Limits` keeps it from hanging or eating
memory: every string it builds (`*`, `+`, `%`, `~`, string methods, width-taking filters) is
checked against a size cap *before* it is allocated where the size can be known, and after
otherwise; loop iterations and calls are counted; everything it writes (including text captured
by `set` blocks and macros) is counted; a render has a time limit. The loop, concatenation and
output checks are put into the parsed template (`_Guard`), so they cover every construct.

A file without a template gets ChatML, as llama.cpp does (`llama_chat_apply_template` falls back
to "chatml"). That includes Gemma-3-270M: it is a base model, never trained on Gemma's
`<start_of_turn>` format, so there is no "right" format to prefer, and using llama.cpp's choice
keeps prompts — and so token ids and logits — comparable with llama.cpp.
"""
from __future__ import annotations

import contextvars
import json
import re
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from edgellm.errors import TemplateError, TemplateLimitError

MAX_CHARS = 1 << 20  # a string built by the template, and the prompt, at most (or 4x the messages)
MAX_WRITTEN = 4  # x the cap: all text written, counting text captured by set blocks and macros
MAX_STEPS = 1_000_000  # loop iterations + calls in one render
MAX_SECONDS = 1.0  # one render (and the compile of a template)
MAX_INT_BITS = 1 << 15  # integers a template computes (2**10**8 would take minutes)

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
    if isinstance(indent, str) and len(indent) > 64 or isinstance(indent, int) and indent > 64:
        _limits().refuse(f"a tojson indent of {indent if isinstance(indent, int) else len(indent)}")
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """`{% generation %}…{% endgeneration %}`: marks the assistant's part; renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Limits:
    """The budget of one compile or render; reached through `_LIMITS` by the sandbox's hooks."""

    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self.max_chars = max_chars
        self.steps = self.written = 0
        self.next_clock = 256
        self.deadline = time.monotonic() + MAX_SECONDS

    def fail(self, what: str) -> TemplateLimitError:
        return TemplateLimitError(
            f"the chat template {what}; a template is limited to {self.max_chars} characters per "
            f"string and prompt, {MAX_STEPS} loop steps and {MAX_SECONDS:g} s. The template in this "
            "file is broken or hostile: pass another one.")

    def step(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise self.fail(f"ran more than {MAX_STEPS} loop steps and calls")
        if self.steps >= self.next_clock:
            self.next_clock = self.steps + 256
            self.clock()

    def clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.fail(f"ran longer than {MAX_SECONDS:g} s")

    def size(self, n: int, what: str = "a string") -> None:
        if n > self.max_chars:
            raise self.fail(f"builds {what} of {n} characters")

    def refuse(self, what: str) -> None:
        raise self.fail(f"asks for {what}")

    def checked(self, value: Any) -> Any:
        """`value` if its size (characters of a string; items plus the characters of string
        items of a list or tuple) is within the cap."""
        if isinstance(value, str):
            self.size(len(value))
        elif isinstance(value, (list, tuple)):
            self.size(len(value) + sum(len(x) for x in value if isinstance(x, str)), "a list")
        return value

    def write(self, text: Any) -> Any:
        self.written += len(text) if isinstance(text, str) else 1
        if self.written > MAX_WRITTEN * self.max_chars:
            raise self.fail(f"writes more than {MAX_WRITTEN * self.max_chars} characters")
        return text


_LIMITS: contextvars.ContextVar[_Limits] = contextvars.ContextVar("edgellm_template_limits")


def _limits() -> _Limits:
    try:
        return _LIMITS.get()
    except LookupError:  # a hook outside render/compile (cannot happen through ChatTemplate)
        limits = _Limits()
        _LIMITS.set(limits)
        return limits


# printf-style conversions and str.format fields: the widths and precisions they ask for
_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FIELD = re.compile(r"\{[^{}]*\}")


def _check_printf(fmt: str, lim: _Limits) -> None:
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            if n == "*" or (n and int(n) > lim.max_chars):
                lim.refuse(f"a %-format width of {n}")


def _check_format(fmt: str, args: tuple, lim: _Limits) -> None:
    for field in _FIELD.findall(fmt):
        for n in re.findall(r"\d+", field):
            if int(n) > lim.max_chars:
                lim.refuse(f"a format width of {n}")
    for a in args:
        if isinstance(a, int) and a > lim.max_chars:  # a nested width: '{:{}}'.format(x, 10**9)
            lim.refuse(f"a format width of {a}")


def _check_int(n: Any, lim: _Limits, what: str) -> None:
    if isinstance(n, int) and n > lim.max_chars:
        lim.refuse(what)


def _bounded_filter(name: str, func: Any) -> Any:
    """`func` (a jinja filter) with the limits: widths and counts checked before it runs, the
    result's size after."""

    @wraps(func)
    def filtered(*args: Any, **kwargs: Any) -> Any:
        lim = _limits()
        lim.step()
        plain = [a for a in args if not isinstance(a, (jinja2.runtime.Context, jinja2.nodes.EvalContext,
                                                        jinja2.Environment))]
        value, rest = (plain[0], plain[1:]) if plain else (None, [])
        if name in ("center", "indent", "batch", "slice", "wordwrap", "truncate"):
            for n in (*rest, *kwargs.values()):
                _check_int(n, lim, f"a '{name}' filter argument of {n}")
            if name == "indent" and isinstance(value, str):
                width = (rest or [kwargs.get("width", 4)])[0]
                pad = width if isinstance(width, int) else len(str(width))
                lim.size(len(value) + pad * (value.count("\n") + 1))
        elif name == "format" and isinstance(value, str):
            _check_printf(value, lim)
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2:
            old, new = str(rest[0]), str(rest[1])
            hits = value.count(old) if old else len(value) + 1
            lim.size(len(value) + hits * len(new))
        elif name == "join" and value is not None and not isinstance(value, str):
            value = list(value)
            lim.step(len(value))
            sep = rest[0] if rest else kwargs.get("d", "")
            lim.size(sum(len(x) if isinstance(x, str) else 20 for x in value)
                     + len(str(sep)) * max(len(value) - 1, 0))
            args = tuple(value if a is plain[0] else a for a in args)
        elif name == "tojson":
            _check_int(kwargs.get("indent", rest[0] if rest else None), lim, "a tojson indent")
        return lim.checked(func(*args, **kwargs))

    return filtered


_STR_WIDTH_METHODS = ("center", "ljust", "rjust", "zfill")


@jinja2.pass_context
def _loop(context: Any, iterable: Any) -> Any:
    """Every `for` loop iterates through this: each item is a step."""
    lim = _limits()
    for item in iterable:
        lim.step()
        yield item


@jinja2.pass_context
def _sized(context: Any, value: Any) -> Any:
    """Every `~` concatenation passes through this."""
    return _limits().checked(value)


@jinja2.pass_context
def _written(context: Any, value: Any) -> Any:
    """Everything a template writes passes through this (also text a set block or macro captures)."""
    return _limits().write(value)


class _Guard(NodeTransformer):
    """Puts the loop, concatenation and output checks into a parsed template."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "edgellm_loop", [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return nodes.Filter(node, "edgellm_sized", [], [], None, None, lineno=node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [nodes.Filter(nodes.Const(n.data, lineno=n.lineno) if isinstance(n, nodes.TemplateData)
                                   else n, "edgellm_written", [], [], None, None, lineno=n.lineno)
                      for n in node.nodes]
        return node


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing at the first unsafe attribute access (jinja2 would return
    an undefined value that renders as "", hiding the attempt), with the limits: operators that
    build strings or big integers, calls and filters checked (see `_Limits`)."""

    intercepted_binops = frozenset(("*", "**", "%", "+"))  # also stops jinja folding them at compile

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(edgellm_loop=_loop, edgellm_sized=_sized, edgellm_written=_written)
        self.globals["lipsum"] = _lipsum

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _Guard().visit(super()._parse(source, name, filename))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        lim = _limits()
        lim.step()
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*":
            if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                lim.refuse(f"an integer of {left.bit_length() + right.bit_length()} bits")
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 0:
                    lim.checked(seq)
                    lim.size(len(seq) * n, "a repeated string or list")
        elif operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * left.bit_length() > MAX_INT_BITS:
                lim.refuse(f"an integer of about {right * left.bit_length()} bits")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, lim)
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            lim.size(len(left) + len(right))
        return lim.checked(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        lim = _limits()
        lim.step()
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        wrapped = getattr(__obj, "__wrapped__", None)  # the sandbox's str.format wrapper
        if isinstance(getattr(wrapped, "__self__", None), str):
            _check_format(wrapped.__self__, args, lim)
        if isinstance(owner, str):
            if name in _STR_WIDTH_METHODS and args:
                _check_int(args[0], lim, f"a {name}() width of {args[0]}")
            elif name == "expandtabs":
                tab = args[0] if args else kwargs.get("tabsize", 8)
                if isinstance(tab, int):
                    lim.size(len(owner) + owner.count("\t") * tab)
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str):
                hits = owner.count(args[0]) if args[0] else len(owner) + 1
                lim.size(len(owner) + hits * len(str(args[1])))
            elif name == "join" and args:
                items = list(args[0])
                lim.step(len(items))
                lim.size(sum(len(x) for x in items if isinstance(x, str)) + len(owner) * len(items))
                args = (items, *args[1:])
            elif name in ("format", "format_map"):
                _check_format(owner, args, lim)
        return lim.checked(super().call(__context, __obj, *args, **kwargs))


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """jinja's lorem-ipsum global with its paragraph count and length bounded."""
    from jinja2.utils import generate_lorem_ipsum

    if not all(isinstance(v, int) for v in (n, min, max)) or n * max > 100_000:
        _limits().refuse(f"lipsum() of {n} paragraphs of up to {max} words")
    return generate_lorem_ipsum(n, html, min, max)


class ChatTemplate:
    """A chat template compiled once in the sandbox; `render` turns messages into prompt text."""

    def __init__(self, source: str | None) -> None:
        self.source = source if source else CHATML_TEMPLATE
        self.is_fallback = not source
        env = _Sandbox(
            trim_blocks=True, lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationBlock])
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        token = _LIMITS.set(_Limits())  # jinja evaluates constant expressions while compiling
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(
                f"the chat template does not parse (line {exc.lineno}: {exc.message}). Pass a "
                "working template, or none to use ChatML.") from None
        except TemplateError:
            raise
        except Exception as exc:  # MemoryError, RecursionError, ... from a crafted template
            raise TemplateError(f"the chat template does not compile ({type(exc).__name__}: {exc}). "
                                "Pass a working template, or none to use ChatML.") from None
        finally:
            _LIMITS.reset(token)

    def render(self, messages: Sequence[Mapping[str, Any]], *, bos_token: str, eos_token: str,
               add_generation_prompt: bool = True, **variables: Any) -> str:
        """Prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        `variables` are passed to the template as well (e.g. tools=[...], documents=[...])."""
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise TemplateError(f"message {i} is {message!r}; each message must be a dict with a "
                                    "string 'role' (and usually a 'content').")
        given = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
        limits = _Limits(max(MAX_CHARS, 4 * given))  # a user's own long messages always fit
        token = _LIMITS.set(limits)
        try:
            out: list[str] = []
            n = 0
            for piece in self._template.generate(
                    messages=[dict(m) for m in messages], bos_token=bos_token, eos_token=eos_token,
                    add_generation_prompt=add_generation_prompt, **variables):
                n += len(piece)
                limits.size(n, "a prompt")
                limits.clock()
                out.append(piece)
            return "".join(out)
        except TemplateError:
            raise
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
        finally:
            _LIMITS.reset(token)


def render_chat(template: str | None, messages: Sequence[Mapping[str, Any]], *, bos_token: str,
                eos_token: str, add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render `messages` with `template` (the file's tokenizer.chat_template; None → ChatML)."""
    return ChatTemplate(template).render(messages, bos_token=bos_token, eos_token=eos_token,
                                         add_generation_prompt=add_generation_prompt, **variables)
