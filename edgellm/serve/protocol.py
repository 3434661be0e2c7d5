"""The OpenAI wire format: request bodies checked field by field into what `Model.submit` takes, and
the JSON shapes of responses, stream chunks and errors.

Every field a body may carry is named here. A field edgellm does not implement (n > 1, logit_bias,
...) or does not know at all is a 400 that names it, never silently ignored, so a client learns at
once what this server will not do for it. Tools, response_format and llama-server's grammar /
json_schema are checked here for shape and by the model for meaning (a schema that does not
compile is a 400 naming the field).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Defaults where a body leaves a field out: edgellm's (and llama-server's) sampling defaults.
DEFAULT_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_overloaded_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    """The keyword arguments of `Model.submit` a request asks for."""

    max_tokens: int | None = None  # None: until the context is full
    temperature: float = DEFAULT_SAMPLING["temperature"]
    top_k: int = DEFAULT_SAMPLING["top_k"]
    top_p: float = DEFAULT_SAMPLING["top_p"]
    min_p: float = DEFAULT_SAMPLING["min_p"]
    repeat_penalty: float = DEFAULT_SAMPLING["repeat_penalty"]
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: no log-probabilities; k: the sampled token's and k alternatives
    ignore_eos: bool = False

    def submit_kwargs(self, n_ctx: int) -> dict:
        return {"max_tokens": n_ctx if self.max_tokens is None else self.max_tokens,
                "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": self.min_p,
                "repeat_penalty": self.repeat_penalty, "seed": self.seed, "stop": tuple(self.stop),
                "ignore_eos": self.ignore_eos, "logprobs": self.logprobs}


@dataclass
class Parsed:
    """A checked request: what to run and how to answer."""

    kind: str  # "chat" | "completion"
    prompt: object  # chat: list of {"role", "content": str}; completion: str or list[int]
    sampling: Sampling
    model: str | None
    stream: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)  # grammar and tool arguments of Model.submit_chat / submit


# Fields each endpoint accepts; "unsupported" ones are accepted only at their no-op value.
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
           "repeat_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "logprobs", "user", "n",
           "ignore_eos", "grammar", "json_schema", "response_format"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                         "functions", "function_call", "response_format", "parallel_tool_calls", "logit_bias",
                         "store", "metadata", "modalities", "audio", "prediction", "reasoning_effort",
                         "service_tier", "web_search_options"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix", "logit_bias"}
# field -> the values that mean "not used" (anything else is a 400 naming the field)
_NO_OP = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
          "functions": (None, []), "function_call": (None, "none"), "logit_bias": (None, {}), "store": (None, False),
          "metadata": (None,), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
          "reasoning_effort": (None,), "service_tier": (None, "auto", "default"), "web_search_options": (None,),
          "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}
_WHY = {"n": "only n=1 is supported", "best_of": "only best_of=1 is supported",
        "presence_penalty": "presence_penalty is not supported (use repeat_penalty)",
        "frequency_penalty": "frequency_penalty is not supported (use repeat_penalty)",
        "functions": "the legacy 'functions' are not supported (use 'tools')",
        "function_call": "the legacy 'function_call' is not supported (use 'tool_choice')"}
ROLES = ("system", "developer", "user", "assistant", "tool")


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name in body:
        if name not in allowed:
            raise _bad(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
    for name, ok in _NO_OP.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v
                                    for v in ok):
            raise _bad(f"'{name}': {_WHY.get(name, f'{name} is not supported')} by this server", name,
                       "unsupported_parameter")


def _grammar_fields(body: dict) -> dict:
    """response_format, llama-server's grammar (GBNF) and json_schema: at most one, checked for shape."""
    out = {}
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise _bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       "response_format")
        if rf["type"] == "json_schema" and not isinstance(rf.get("json_schema"), dict):
            raise _bad("'response_format': json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
        if rf["type"] != "text":
            out["response_format"] = rf
    if body.get("grammar") is not None:
        if not isinstance(body["grammar"], str):
            raise _bad("'grammar' must be a GBNF grammar (a string)", "grammar")
        out["grammar"] = body["grammar"]
    if body.get("json_schema") is not None:
        if not isinstance(body["json_schema"], (dict, bool)):
            raise _bad("'json_schema' must be a JSON schema object", "json_schema")
        out["json_schema"] = body["json_schema"]
    if len(out) > 1:
        names = sorted(out)
        raise _bad(f"'{names[0]}' and '{names[1]}' cannot be combined: a request takes one grammar", names[1])
    return out


def _tool_fields(body: dict) -> dict:
    out = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str):
                raise _bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           f"tools[{i}]")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise _bad(f"'tools[{i}].function.parameters' must be a JSON schema object",
                           f"tools[{i}].function.parameters")
        if tools:
            out["tools"] = tools
    choice = body.get("tool_choice")
    if choice is not None:
        ok = choice in ("auto", "none", "required") or (
            isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str))
        if not ok:
            raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", "tool_choice")
        if isinstance(choice, dict) and choice["function"]["name"] not in \
                {t["function"]["name"] for t in out.get("tools", [])}:
            raise _bad(f"'tool_choice' names {choice['function']['name']!r}, which is not among the tools",
                       "tool_choice")
        if choice == "required" and not out.get("tools"):
            raise _bad("'tool_choice': \"required\" needs 'tools'", "tool_choice")
        out["tool_choice"] = choice
    ptc = body.get("parallel_tool_calls")
    if ptc is not None:
        if not isinstance(ptc, bool):
            raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        out["parallel_tool_calls"] = ptc
    return out


def _number(body: dict, name: str, lo: float, hi: float, *, integer: bool = False, lo_open: bool = False):
    """body[name] checked to lie in [lo, hi] ((lo, hi] with lo_open); None when absent or null."""
    v = body.get(name)
    if v is None:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _bad(f"'{name}' must be {kind}, got {v!r}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        lo_s = f"> {lo}" if lo_open else f">= {lo}"
        raise _bad(f"'{name}' must be {kind} {lo_s} and <= {hi}, got {v!r}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _sampling(body: dict, max_tokens_field: str | None = None) -> Sampling:
    s = Sampling()
    for name in ("max_tokens", max_tokens_field):
        if name is not None and body.get(name) is not None:
            s.max_tokens = _number(body, name, 1, 2**31 - 1, integer=True)
    for name, lo, hi, integer, lo_open in (("temperature", 0, 2, False, False), ("top_p", 0, 1, False, True),
                                           ("top_k", 0, 2**31 - 1, True, False), ("min_p", 0, 1, False, False),
                                           ("repeat_penalty", 0, 10, False, True),
                                           ("seed", -1, 2**63 - 1, True, False)):
        v = _number(body, name, lo, hi, integer=integer, lo_open=lo_open)
        if v is not None:
            setattr(s, name, v)
    if s.seed == -1:  # llama-server's "a random seed"
        s.seed = None
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise _bad("'stop' must be a string or a list of strings", "stop")
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
        s.stop = [x for x in stop if x]
    s.ignore_eos = _flag(body, "ignore_eos")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("'user' must be a string", "user")
    return s


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise _bad("'stream_options' takes only {\"include_usage\": bool}", "stream_options")
    return stream, _flag(opts, "include_usage")


def _model(body: dict) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise _bad("'model' must be a string", "model")
    return m


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # content parts: only text ones
        out = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{i}].content: only text parts are supported, got {kind!r}",
                           f"messages[{i}].content")
            out.append(part["text"])
        return "".join(out)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body) -> Parsed:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    clean = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        for key in msg:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id", "refusal"):
                raise _bad(f"messages[{i}].{key} is not supported", f"messages[{i}].{key}")
        role = "system" if msg["role"] == "developer" else msg["role"]
        m = {"role": role, "content": _content(msg, i)}
        if msg.get("tool_calls") is not None:
            calls = msg["tool_calls"]
            if role != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str)
                    and isinstance(c["function"].get("arguments", "{}"), (str, dict)) for c in calls):
                raise _bad(f"messages[{i}].tool_calls must be an assistant's list of {{\"id\", \"type\": "
                           "\"function\", \"function\": {\"name\", \"arguments\"}}", f"messages[{i}].tool_calls")
            m["tool_calls"] = calls
        if role == "tool":
            tid = msg.get("tool_call_id")
            if tid is not None and not isinstance(tid, str):
                raise _bad(f"messages[{i}].tool_call_id must be a string", f"messages[{i}].tool_call_id")
            if tid is not None:
                m["tool_call_id"] = tid
        if isinstance(msg.get("name"), str):
            m["name"] = msg["name"]
        clean.append(m)
    s = _sampling(body, "max_completion_tokens")
    if _flag(body, "logprobs"):
        s.logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True) or 0
    elif body.get("top_logprobs") is not None:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, include_usage = _stream_options(body)
    extra = {**_grammar_fields(body), **_tool_fields(body)}
    if extra.get("tools") and extra.get("tool_choice") != "none" and set(extra) & {"grammar", "json_schema",
                                                                                   "response_format"}:
        raise _bad("'tools' cannot be combined with a grammar or response_format", "tools")
    return Parsed("chat", clean, s, _model(body), stream, include_usage, extra)


def parse_completion(body) -> Parsed:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
        raise _bad("'prompt': only one prompt per request is supported", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise _bad("'prompt' must be a non-empty string or a list of token ids", "prompt")
    s = _sampling(body)
    k = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    s.logprobs = k
    stream, include_usage = _stream_options(body)
    return Parsed("completion", prompt, s, _model(body), stream, include_usage, _grammar_fields(body))


# --- responses ----------------------------------------------------------------------------------
def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.gen_tokens,
            "total_tokens": stats.prompt_tokens + stats.gen_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def timings(stats) -> dict:
    """llama-server's `timings` object (plus ttft_ms)."""
    prompt_n = stats.prompt_tokens - stats.cached_tokens
    return {"cache_n": stats.cached_tokens, "prompt_n": prompt_n, "prompt_ms": stats.prompt_ms,
            "prompt_per_token_ms": stats.prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1000 * prompt_n / stats.prompt_ms if stats.prompt_ms else 0.0,
            "predicted_n": stats.gen_tokens, "predicted_ms": stats.gen_ms,
            "predicted_per_token_ms": stats.gen_ms / stats.gen_tokens if stats.gen_tokens else 0.0,
            "predicted_per_second": 1000 * stats.gen_tokens / stats.gen_ms if stats.gen_ms else 0.0,
            "ttft_ms": 1000 * stats.ttft_s, "draft_n": stats.draft_n, "draft_n_accepted": stats.draft_n_accepted}


def _token_entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(pieces) -> dict:
    """OpenAI chat `logprobs` for (token text, logprob, ((text, logprob), ...)) entries."""
    return {"content": [dict(_token_entry(text, lp), top_logprobs=[_token_entry(t, tlp) for t, tlp in top])
                        for text, lp, top in pieces]}


def completion_logprobs(pieces, offset: int = 0) -> dict:
    """The legacy completions `logprobs` object; text offsets count from `offset` characters."""
    tokens, lps, tops, offsets = [], [], [], []
    for text, lp, top in pieces:
        offsets.append(offset)
        offset += len(text)
        tokens.append(text)
        lps.append(lp)
        tops.append(dict(top))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_message(rid: str, created: int, model: str, text: str, finish: str | None, pieces, logprobs: bool,
                 tool_calls=()) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": [c.to_openai() for c in tool_calls]}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message,
                         "logprobs": chat_logprobs(pieces) if logprobs else None, "finish_reason": finish}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None, pieces=None,
               logprobs: bool = False) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta,
                         "logprobs": chat_logprobs(pieces) if logprobs and pieces else None,
                         "finish_reason": finish}]}


def tool_call_deltas(calls) -> list[dict]:
    """Streamed tool calls in OpenAI's shape: per call, a delta with its id and name, then one with
    its arguments."""
    out = []
    for i, c in enumerate(calls):
        out.append({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}]})
        out.append({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]})
    return out


def completion_body(rid: str, created: int, model: str, text: str, finish: str | None, logprobs=None) -> dict:
    """A completion, or one chunk of a streamed one (the legacy API names both "text_completion")."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def usage_chunk(kind: str, rid: str, created: int, model: str, stats) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(stats),
            "timings": timings(stats)}
