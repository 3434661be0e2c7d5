"""Structured output and tool calls through the API, on the real SmolLM2 and Qwen2.5-Coder files:
grammars hold on every seed, a grammar that admits the free answer changes nothing, calls parse
and validate, chat templates render tools and tool messages as llama-server does."""
import json
from pathlib import Path

import jsonschema
import pytest

import edgellm
from edgellm import toolcalls as tc
from edgellm.errors import InvalidArgumentError

DATA = Path(__file__).parent / "data"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["admin", "user", "guest"]}, "maxItems": 3},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "address", "tags", "active"], "additionalProperties": False}


@pytest.fixture(scope="module")
def smol(smollm2_path):
    with edgellm.load(smollm2_path, n_ctx=1024, n_seq=8) as m:
        yield m


@pytest.fixture(scope="module")
def qwen(qwen05_path):
    with edgellm.load(qwen05_path, n_ctx=1024, n_seq=8) as m:
        yield m


def _all(model, n, **kw):
    """The finished ChatRequests of n seeds (decoded together)."""
    messages = kw.pop("messages")
    reqs = [model.submit_chat(messages, seed=seed, **kw) for seed in range(n)]
    for r in reqs:
        r.text()
    return reqs


# --- rendering ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, fixture", [("qwen", "chat_qwen2.5-coder-0.5b.json"),
                                           ("smol", "chat_smollm2-135m.json")])
def test_tools_and_tool_messages_render_as_llama_server_renders_them(name, fixture, request):
    model = request.getfixturevalue(name)
    cases = json.loads((DATA / fixture).read_text())["cases"]
    assert any(c.get("tools") for c in cases) and any(m.get("role") == "tool" for c in cases for m in c["messages"])
    for case in cases:
        assert model.render_chat(case["messages"], tools=case.get("tools")) == case["prompt"]


def test_call_format_comes_from_the_template(qwen, smol):
    assert qwen.call_format().name == "hermes"
    assert smol.call_format() is tc.GENERIC  # its template ignores tools


# --- grammars ---------------------------------------------------------------------------------------------
def test_json_schema_answers_validate_on_every_seed(smol):
    reqs = _all(smol, 16, messages=[{"role": "user", "content": "Describe a user of a web shop as JSON."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                         "strict": True}},
                temperature=0.8, max_tokens=200)
    for r in reqs:
        assert r.finish_reason == "stop", r.content
        jsonschema.validate(json.loads(r.content), PERSON)


def test_json_object_answers_parse_on_every_seed(qwen):
    reqs = _all(qwen, 16, messages=[{"role": "user", "content": "List three fruits as a JSON object."}],
                response_format={"type": "json_object"}, temperature=0.8, max_tokens=300)
    for r in reqs:
        assert r.finish_reason == "stop", r.content
        assert isinstance(json.loads(r.content), dict)


def test_a_grammar_that_admits_the_free_answer_changes_nothing(smol):
    prompt = smol.render_chat([{"role": "user", "content": "Write one sentence about the sea."}])
    free = [c.token for c in smol.generate(prompt, temperature=0, max_tokens=24)]
    req = smol.submit(prompt, temperature=0, max_tokens=24, regex=r"(?s:.*)")
    held = [c.token for c in req]
    assert held == free
    # and a seeded sampled answer, drawn through the same grammar, is the free one too
    free_s = [c.token for c in smol.generate(prompt, temperature=0.8, seed=7, max_tokens=24)]
    held_s = [c.token for c in smol.submit(prompt, temperature=0.8, seed=7, max_tokens=24, regex=r"(?s:.*)")]
    assert held_s == free_s


@pytest.mark.parametrize("ask", ['Reply with only this JSON, no code fence: {"city": "Paris", "unit": "celsius"}',
                                 'Output the raw JSON object {"city": "Lyon", "unit": "kelvin"} and nothing else.'])
def test_a_json_schema_that_admits_the_free_answer_changes_nothing(qwen, ask):
    msgs = [{"role": "user", "content": ask}]
    free = qwen.submit_chat(msgs, temperature=0, max_tokens=40)
    free_tokens = [c.token for c in free]
    assert free.finish_reason == "stop" and json.loads(free.content)  # the model answers bare JSON
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}
    for rf in ({"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}, {"type": "json_object"}):
        held = qwen.submit_chat(msgs, temperature=0, max_tokens=40, response_format=rf)
        assert [c.token for c in held] == free_tokens and held.finish_reason == "stop"


def test_a_regex_and_a_gbnf_grammar_hold(smol):
    prompt = smol.render_chat([{"role": "user", "content": "Pick a number."}])
    for seed in range(5):
        text = "".join(c.text for c in smol.submit(prompt, seed=seed, regex=r"[0-9]{3}-[a-z]{2}", max_tokens=20))
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha(), text
        text = "".join(c.text for c in smol.submit(prompt, seed=seed, max_tokens=20,
                                                   grammar='root ::= ("yes" | "no") "!"'))
        assert text in ("yes!", "no!")


def test_max_tokens_inside_unfinished_json_is_length(smol):
    r = _all(smol, 1, messages=[{"role": "user", "content": "A user as JSON."}],
             response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, max_tokens=5)[0]
    assert r.finish_reason == "length" and not r.tool_calls


@pytest.mark.parametrize("kw, words", [
    ({"json_schema": {"type": "frobnicate"}}, "json_schema"),
    ({"regex": "[a-"}, "regex"),
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, "one"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_grammars_are_clear_errors(smol, kw, words):
    with pytest.raises(InvalidArgumentError) as e:
        smol.submit("Hi", **kw)
    assert words in str(e.value)


# --- tool calls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen", "smol"])
def test_required_tool_calls_validate_on_20_seeds(name, request):
    model = request.getfixturevalue(name)
    reqs = _all(model, 20, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.8, max_tokens=120)
    for r in reqs:
        assert r.finish_reason == "tool_calls", r.content
        assert len(r.tool_calls) == 1 and r.tool_calls[0].name == "get_weather"
        assert r.tool_calls[0].id.startswith("call_")
        jsonschema.validate(json.loads(r.tool_calls[0].arguments), WEATHER["function"]["parameters"])


def test_a_named_tool_choice_calls_that_tool(qwen):
    r = _all(qwen, 1, messages=ASK, tools=[WEATHER, TIME], temperature=0,
             tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=60)[0]
    assert [c.name for c in r.tool_calls] == ["get_time"] and json.loads(r.tool_calls[0].arguments) == {}


def test_parallel_tool_calls_decides_whether_a_second_call_may_follow(qwen):
    from edgellm.grammar import Constraint

    vocab = qwen.grammar_vocab.get()
    tools = tc.check_tools([WEATHER, TIME])
    one = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ids = qwen.tokenize(one + "\n" + one, add_special=False, parse_special=True)
    second = len(qwen.tokenize(one + "\n", add_special=False, parse_special=True))
    for parallel in (True, False):
        c = Constraint(vocab, tc.call_grammar(vocab, tc.FORMATS[0], tools, "required", parallel)[0])
        taken = 0
        for tok in ids:
            if not c.allows(tok):
                break
            c.accept(tok)
            taken += 1
        assert taken == (len(ids) if parallel else second - 1), parallel
        if parallel:
            assert c.matcher.is_accepting()


def test_the_last_chunk_carries_the_calls(qwen):
    chunks = list(qwen.chat(ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=80))
    assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].tool_calls
    assert all(not c.text for c in chunks)  # the call is not content
    assert qwen.stats.finish_reason == "tool_calls"


def test_a_tool_result_round_trip_gives_text(qwen):
    call = {"id": "call_0", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"temperature": 21})}]
    r = _all(qwen, 1, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=60)[0]
    assert not r.tool_calls and r.finish_reason == "stop" and "21" in r.content


def test_auto_lets_text_through(smol):
    r = _all(smol, 1, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], temperature=0,
             max_tokens=80)[0]
    # the generic answer is JSON either way: a response becomes content, a call becomes a call
    assert (r.content and not r.tool_calls) or (r.tool_calls and not r.content)


def test_tool_choice_none_is_plain_chat(smol):
    plain = "".join(c.text for c in smol.chat(ASK, temperature=0, max_tokens=16))
    none = "".join(c.text for c in smol.chat(ASK, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=16))
    assert none == plain


@pytest.mark.parametrize("kw, words", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "name"),
    ({"tools": [WEATHER, WEATHER]}, "two tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "json_schema": {"type": "object"}}, "cannot be combined"),
    ({"tools": "get_weather"}, "tools must be a list"),
])
def test_bad_tools_are_clear_errors(smol, kw, words):
    with pytest.raises(InvalidArgumentError) as e:
        smol.submit_chat(ASK, **kw)
    assert words in str(e.value)


# --- parsing (every format, on text) --------------------------------------------------------------------
@pytest.mark.parametrize("fmt, text, content, n", [
    ("hermes", ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "X", "unit": "celsius"}}\n'
               '</tool_call>'), "Sure.", 1),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "X"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>'), "", 2),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', None, 0),
    ("hermes", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>', None, 0),
    ("mistral", ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": '
                '{"city": "Y"}}]'), "", 2),
    ("phi4", '<|tool_call|>[{"name": "get_time", "arguments": {}}]<|/tool_call|>', "", 1),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Z"}}', "", 1),
    ("llama3", 'It is sunny.', None, 0),
])
def test_answers_parse_in_every_format(fmt, text, content, n):
    f = next(f for f in tc.FORMATS if f.name == fmt)
    got, calls = tc.parse_answer(text, f, tc.check_tools([WEATHER, TIME]))
    assert len(calls) == n
    assert got == (text if content is None else content)
    for c in calls:
        assert isinstance(json.loads(c.arguments), dict)


def test_generic_answers_parse():
    tools = tc.check_tools([WEATHER])
    assert tc.parse_answer('{"response": "Hello"}', tc.GENERIC, tools) == ("Hello", [])
    content, calls = tc.parse_answer('{"tool_call": {"name": "get_weather", "arguments": {"city": "A"}}}',
                                     tc.GENERIC, tools)
    assert content == "" and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "A"}
    assert tc.parse_answer("plain words", tc.GENERIC, tools) == ("plain words", [])


def test_grammars_of_every_format_compile_and_accept_a_call(qwen):
    from edgellm.grammar import Constraint

    vocab = qwen.grammar_vocab.get()
    tools = tc.check_tools([WEATHER, TIME])
    call = '{"name": "get_time", "arguments": {}}'
    texts = {"hermes": f"<tool_call>\n{call}\n</tool_call>", "mistral": f"[TOOL_CALLS][{call}]",
             "phi4": f"<|tool_call|>[{call}]<|/tool_call|>",
             "llama3": '{"name": "get_time", "parameters": {}}'}
    for f in tc.FORMATS:
        grammar, _ = tc.call_grammar(vocab, f, tools, "required", parallel=False)
        c = Constraint(vocab, grammar)
        for tok in qwen.tokenize(texts[f.name], add_special=False, parse_special=True):
            assert c.allows(tok), (f.name, tok)
            c.accept(tok)
        assert c.matcher.is_accepting(), f.name
