"""Tool calls and structured output over a real socket with the official `openai` client, on the
real Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M-Instruct files."""
import json

import jsonschema
import openai
import pytest

from served import Served

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
ARGS = WEATHER["function"]["parameters"]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ITEM = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "kind": {"enum": ["book", "pen", "cup"]}},
        "required": ["title", "qty", "kind"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3},
                                          "paid": {"type": "boolean"}},
         "required": ["items", "paid"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["qwen05_path", "smollm2_path"])
def srv(request):
    s = Served(request.getfixturevalue(request.param), n_ctx=1024, n_seq=4, threads=2)
    yield s
    s.close()


def _reassemble(stream):
    """(content, {index: {"id", "name", "arguments"}}, finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, None
    for ev in stream:
        if not ev.choices:
            continue
        ch = ev.choices[0]
        d = ch.delta
        content += d.content or ""
        for tcd in d.tool_calls or []:
            c = calls.setdefault(tcd.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = tcd.id or c["id"]
            if tcd.function is not None:
                c["name"] += tcd.function.name or ""
                c["arguments"] += tcd.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, calls, finish


def test_required_calls_validate_on_20_seeds_and_stream_the_same(srv):
    for seed in range(20):
        r = srv.client.chat.completions.create(model=srv.name, messages=ASK, tools=[WEATHER],
                                               tool_choice="required", temperature=0.8, seed=seed, max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message.content
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), ARGS)
        if seed < 3:  # the streamed form of the same seed is the same call
            content, calls, finish = _reassemble(srv.client.chat.completions.create(
                model=srv.name, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.8,
                seed=seed, max_tokens=120, stream=True))
            assert finish == "tool_calls" and not content
            assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
                [(call.function.name, json.loads(call.function.arguments))]
            assert calls[0]["id"]


def test_a_tool_result_round_trip_gives_a_text_answer(srv):
    r = srv.client.chat.completions.create(model=srv.name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=120)
    msg = r.choices[0].message
    follow = ASK + [msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": json.dumps({"temp_c": 21})}]
    r2 = srv.client.chat.completions.create(model=srv.name, messages=follow, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=40)
    assert r2.choices[0].finish_reason in ("stop", "length") and r2.choices[0].message.content
    assert not r2.choices[0].message.tool_calls


def test_json_schema_answers_validate(srv):
    msgs = [{"role": "user", "content": "An order of a few things from a stationery shop, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    for seed in range(10):
        r = srv.client.chat.completions.create(model=srv.name, messages=msgs, response_format=rf, temperature=0.8,
                                               seed=seed, max_tokens=200)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)


def test_llama_server_fields_and_completions(srv):
    r = srv.client.completions.create(model=srv.name, prompt="The answer is", max_tokens=10, temperature=0.8,
                                      extra_body={"grammar": 'root ::= ("yes" | "no") "."'})
    assert r.choices[0].text in ("yes.", "no.")
    r = srv.client.chat.completions.create(model=srv.name, messages=ASK, max_tokens=60,
                                           extra_body={"json_schema": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 20}}, "required": ["city"]}})
    assert set(json.loads(r.choices[0].message.content)) == {"city"}


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema"),
    ({"extra_body": {"grammar": "root ::= missing"}}, "grammar"),
    ({"extra_body": {"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}}, "cannot be combined"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "other"),
])
def test_bad_grammars_and_tools_are_400_with_the_reason(srv, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model=srv.name, messages=ASK, max_tokens=4, **extra)
    assert words in e.value.body["message"]


def test_max_tokens_inside_a_call_is_length_with_text(srv):
    r = srv.client.chat.completions.create(model=srv.name, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           max_tokens=6, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and not ch.message.tool_calls and ch.message.content
