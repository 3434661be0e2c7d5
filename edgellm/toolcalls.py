"""OpenAI tool calls on a chat template: checked tools, the call format a template speaks, the
grammar that makes a call valid, and the parse of an answer into content and calls.

The format comes from the chat template, as llama.cpp's chat parsers pick it: Hermes / Qwen2.5 /
Qwen3 (`<tool_call>{...}</tool_call>`), Mistral (`[TOOL_CALLS][...]`), Phi-4-mini
(`<|tool_call|>[...]<|/tool_call|>`), Llama 3.x (a bare `{"name", "parameters"}` object), and a
generic JSON answer for a template that does not render tools (the tools are described in the
system message and the answer is `{"tool_call": ...}` or `{"response": ...}`). With tool_choice
"required" or a named function the grammar holds from the first token; with "auto" it starts at
the format's opening token (a lazy grammar), so text before a call stays content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from edgellm.errors import InvalidArgumentError
from edgellm.grammar import bounded_space

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object's text

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class CallFormat:
    name: str
    marker: str  # text in the chat template that identifies the format
    open: str  # before the call(s): a special token where the vocabulary has one
    close: str  # after the call(s) ("" none)
    listed: bool  # all calls as one JSON array after `open`; else `open call close` per call
    args_key: str = "arguments"


FORMATS = (
    CallFormat("hermes", "<tool_call>", "<tool_call>", "</tool_call>", listed=False),
    CallFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", "", listed=True),
    CallFormat("phi4", "<|tool_call|>", "<|tool_call|>", "<|/tool_call|>", listed=True),
    CallFormat("llama3", "<|python_tag|>", "", "", listed=False, args_key="parameters"),
)
GENERIC = CallFormat("generic", "", "", "", listed=False)


def detect_format(template: str | None, renders_tools: bool) -> CallFormat:
    """The format a chat template speaks; generic when it names none or ignores `tools`."""
    if template and renders_tools:
        for f in FORMATS:
            if f.marker in template:
                return f
    return GENERIC


# --- checking what a caller gives -------------------------------------------------------------------
def check_tools(tools) -> list[dict]:
    """OpenAI `tools`, checked, each as the template sees it: {"type": "function", "function":
    {"name", "description" ("" when absent, as llama-server renders it), "parameters", ...}}."""
    if tools is None:
        return []
    if not isinstance(tools, (list, tuple)):
        raise InvalidArgumentError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidArgumentError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidArgumentError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                                       f"got {name!r}")
        if name in seen:
            raise InvalidArgumentError(f"tools[{i}]: two tools are named {name!r}")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidArgumentError(f"tools[{i}].function.parameters must be a JSON schema object")
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise InvalidArgumentError(f"tools[{i}].function.description must be a string")
        rest = {k: v for k, v in fn.items() if k not in ("name", "description", "parameters")}
        body = {"name": name, "description": desc}
        if "parameters" in fn:
            body["parameters"] = params
        out.append({"type": "function", "function": {**body, **rest}})
    return out


def check_tool_choice(choice, tools: list[dict]) -> str | None:
    """"auto" | "none" | "required" | a tool's name (a named choice); None when no tools."""
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise InvalidArgumentError("tool_choice must be \"auto\", \"none\", \"required\" or "
                                       "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in {t["function"]["name"] for t in tools}:
            raise InvalidArgumentError(f"tool_choice names {name!r}, which is not among the tools")
        return name
    if choice not in ("auto", "none", "required"):
        raise InvalidArgumentError(f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, "
                                   f"got {choice!r}")
    if choice == "required" and not tools:
        raise InvalidArgumentError("tool_choice \"required\" needs tools")
    return choice if tools else None


def template_messages(messages, fmt: CallFormat) -> list[dict]:
    """Messages as chat templates expect them: an assistant's tool-call arguments as objects (as
    llama-server renders them), content None as ""; for the generic format, calls written as the
    JSON answer the model is asked for."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            out.append(m)  # the template's own check names it
            continue
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            parsed = []
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise InvalidArgumentError(f"messages[{i}].tool_calls[{j}] must carry function.name and "
                                               "function.arguments")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise InvalidArgumentError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                                   "JSON") from None
                parsed.append({**c, "function": {**fn, "arguments": args}})
            if fmt is GENERIC:
                answer = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in parsed]
                m.pop("tool_calls")
                m["content"] = json.dumps({"tool_calls": answer} if len(answer) > 1 else {"tool_call": answer[0]})
            else:
                m["tool_calls"] = parsed
        if m.get("content") is None:
            m["content"] = ""
        out.append(m)
    return out


def generic_system_text(tools: list[dict], choice: str, parallel: bool) -> str:
    """What the generic format adds to the system message: the tools and the answer's shape."""
    listing = json.dumps([t["function"] for t in tools], indent=2)
    call = ("{\"tool_calls\": [{\"name\": ..., \"arguments\": {...}}, ...]}" if parallel
            else "{\"tool_call\": {\"name\": ..., \"arguments\": {...}}}")
    if choice == "auto":
        how = f"Answer with one JSON object: {call} to call a tool, or {{\"response\": \"...\"}} to answer directly."
    else:
        how = f"Answer with one JSON object that calls a tool: {call}."
    return f"You can call these tools:\n{listing}\n{how}"


# --- the grammar -------------------------------------------------------------------------------------
def _call_schema(tools: list[dict], fmt: CallFormat) -> dict:
    from edgellm.grammar import closed_objects

    options = [{"type": "object",
                "properties": {"name": {"const": t["function"]["name"]},
                               fmt.args_key: closed_objects(t["function"].get("parameters", {"type": "object"}))},
                "required": ["name", fmt.args_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def call_grammar(vocab, fmt: CallFormat, tools: list[dict], choice: str, parallel: bool) -> tuple[str, list[int]]:
    """(Lark grammar, trigger token ids) for the answer: lazy (triggers) under "auto" where the
    format opens with a special token, from the first token otherwise."""
    if choice not in ("auto", "required"):
        tools = [t for t in tools if t["function"]["name"] == choice]
    schema = _call_schema(tools, fmt)
    if fmt is GENERIC:
        key = "tool_calls" if parallel else "tool_call"
        call = {"type": "array", "items": schema, "minItems": 1} if parallel else schema
        answer = {"type": "object", "properties": {key: call}, "required": [key], "additionalProperties": False}
        if choice == "auto":
            answer = {"anyOf": [answer, {"type": "object", "properties": {"response": {"type": "string"}},
                                         "required": ["response"], "additionalProperties": False}]}
        return f"start: %json {json.dumps(bounded_space(answer))}\n", []
    if fmt.listed:
        body = {"type": "array", "items": schema, "minItems": 1}
        if not parallel:
            body["maxItems"] = 1
        lines = [f"start: {vocab.literal(fmt.open)} calls" + (f" {vocab.literal(fmt.close)}" if fmt.close else ""),
                 f"calls: %json {json.dumps(bounded_space(body))}"]
    else:
        wrap = [vocab.literal(fmt.open) + ' "\\n"'] if fmt.open else []
        tail = ['"\\n" ' + vocab.literal(fmt.close)] if fmt.close else []
        more = ' ("\\n" call)*' if parallel else ""
        lines = [f"start: call{more}",
                 "call: " + " ".join(wrap + ["body"] + tail),
                 f"body: %json {json.dumps(bounded_space(schema))}"]
    triggers = []
    if choice == "auto" and fmt.open and fmt.open in vocab.special:
        triggers = [vocab.special[fmt.open]]
    return "\n".join(lines) + "\n", triggers


# --- reading the answer ---------------------------------------------------------------------------------
def _calls_from(items, fmt: CallFormat, names: set[str]) -> list[ToolCall] | None:
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get(fmt.args_key, item.get("arguments", {}))
        if not isinstance(args, dict):
            return None
        calls.append(ToolCall("call_" + uuid.uuid4().hex[:24], item["name"], json.dumps(args, ensure_ascii=False)))
    return calls or None


def _json_prefix(text: str):
    """The JSON value at the start of text (after blanks) and the rest; None when there is none."""
    text = text.lstrip()
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None, text
    return value, text[end:]


def parse_answer(text: str, fmt: CallFormat, tools: list[dict]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a finished answer (with its special tokens' text); an answer whose call
    does not parse is all content, as llama-server gives it."""
    names = {t["function"]["name"] for t in tools}
    if fmt is GENERIC:
        value, rest = _json_prefix(text)
        if isinstance(value, dict) and not rest.strip():
            if isinstance(value.get("response"), str) and len(value) == 1:
                return value["response"], []
            items = value.get("tool_calls") if "tool_calls" in value else [value.get("tool_call")]
            calls = _calls_from(items if isinstance(items, list) else [], GENERIC, names)
            if calls:
                return "", calls
        return text, []
    if not fmt.open:  # llama3: the answer is the call object
        value, rest = _json_prefix(text)
        calls = _calls_from([value], fmt, names) if isinstance(value, dict) else None
        return ("", calls) if calls and not rest.strip() else (text, [])
    at = text.find(fmt.open)
    if at < 0:
        return text, []
    content, rest = text[:at], text[at:]
    items = []
    while rest.startswith(fmt.open):
        value, rest = _json_prefix(rest[len(fmt.open):])
        if value is None:
            return text, []
        items.extend(value if fmt.listed and isinstance(value, list) else [value])
        rest = rest.lstrip()
        if fmt.close:
            if not rest.startswith(fmt.close):
                return text, []
            rest = rest[len(fmt.close):].lstrip()
    if rest.strip():
        return text, []
    calls = _calls_from(items, fmt, names)
    return (content.rstrip("\n"), calls) if calls else (text, [])


# --- the answer as it streams -----------------------------------------------------------------------------
class ChatRequest:
    """A chat request's Chunks with its tool calls read out: text streams as content until the
    answer opens a call (from the first token where the grammar forces a call); the call's text
    is held back and the last Chunk carries the parsed calls (`tool_calls`, finish_reason
    "tool_calls"), or the held text when it does not parse. Iterate it; `cancel()`, `stats`,
    `text()` and `tool_calls` as a Request."""

    def __init__(self, request, tokenizer, fmt: CallFormat | None, tools: list[dict], holding: bool,
                 triggers=()):
        self.request = request
        self.stats = request.stats
        self._tk = tokenizer
        self._fmt = fmt
        self._tools = tools
        self._holding = holding
        self._triggers = frozenset(triggers)
        self._tokens: list[int] = []
        self._held: list = []
        self.tool_calls: list[ToolCall] = []
        self.content = ""
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        while True:
            out = self.feed(next(self.request))
            if out is not None:
                return out

    def feed(self, chunk):
        """One Chunk of the request in: the Chunk to pass on, or None while a call's text is held."""
        from dataclasses import replace

        if self._fmt is None:
            self.content += chunk.text
            return chunk
        if not self._tk.is_eog(chunk.token):
            self._tokens.append(chunk.token)
        if not self._holding and chunk.token in self._triggers:
            self._holding = True
        if chunk.finish_reason is not None:
            return self._last(chunk, replace)
        if self._holding:
            self._held.append(chunk.text)
            return None
        self.content += chunk.text
        return chunk

    def attach(self, sink) -> None:
        """Push mode (Request.attach), the Chunks passed through `feed` on the engine's thread."""
        def fed(item):
            if item is None or isinstance(item, BaseException):
                sink(item)
                return
            try:
                out = self.feed(item)
            except Exception as exc:  # noqa: BLE001 - never into the engine's step: to the caller
                sink(exc)
                return
            if out is not None:
                sink(out)

        self.request.attach(fed)

    def _last(self, chunk, replace):
        self.done = True
        if not self._holding:
            self.content += chunk.text
            return chunk
        full = self._tk.detokenize(self._tokens, special=True)
        content, calls = parse_answer(full, self._fmt, self._tools) if chunk.finish_reason == "stop" else (full, [])
        if not calls:  # not a call after all (or cut short): the held text is content
            text = "".join(self._held) + chunk.text
            if self._fmt is GENERIC and content != full:
                text = content[len(self.content):] if content.startswith(self.content) else content
            self.content += text
            return replace(chunk, text=text)
        self.tool_calls = calls
        self.stats.finish_reason = "tool_calls"
        text = content[len(self.content):] if content.startswith(self.content) else ""
        self.content += text
        return replace(chunk, text=text, finish_reason="tool_calls", tool_calls=tuple(calls))

    def text(self) -> str:
        for _ in self:
            pass
        return self.content

    @property
    def finish_reason(self):
        return self.stats.finish_reason

    def cancel(self) -> None:
        self.request.cancel()

    close = cancel
