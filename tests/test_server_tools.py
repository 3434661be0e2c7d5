"""Tool calls and structured output over a real socket with the official `openai` client, on the
real Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M-Instruct files."""
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest
from served import Served

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "vs_llamacpp"))
# the requests the dev script also sends to llama-server: one definition of the tool and the schema
from tools_vs_llama_server import ASK, ORDER, WEATHER

ARGS = WEATHER["function"]["parameters"]


@pytest.fixture(scope="module", params=["qwen05_path", "smollm2_path"])
def srv(request):
    # batch_invariant: a seed's answer does not depend on which requests share its steps, so the
    # streamed and the plain form of one seed can be compared while many seeds run at once
    s = Served(request.getfixturevalue(request.param), n_ctx=2048, n_seq=8, threads=2, batch_invariant=True)
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


def _seeds(n, fn):
    """fn(seed) for seeds 0..n-1, eight requests in flight at a time (the server batches them)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, range(n)))


def test_required_calls_validate_on_20_seeds_and_stream_the_same(srv):
    kw = {"model": srv.name, "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "temperature": 0.8, "max_tokens": 120}
    plain = _seeds(20, lambda seed: srv.client.chat.completions.create(seed=seed, **kw))
    streamed = _seeds(20, lambda seed: _reassemble(srv.client.chat.completions.create(seed=seed, stream=True, **kw)))
    for r, (content, calls, finish) in zip(plain, streamed):
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message.content
        (call,) = ch.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), ARGS)
        # the streamed form of the same seed reassembles to the same call
        assert finish == "tool_calls" and not content
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(call.function.name, json.loads(call.function.arguments))]
        assert calls[0]["id"]
    assert len({r.choices[0].message.tool_calls[0].function.arguments for r in plain}) > 1  # seeds differ


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


def test_json_schema_answers_validate_on_50_seeds(srv):
    msgs = [{"role": "user", "content": "An order of a few things from a stationery shop, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    answers = _seeds(50, lambda seed: srv.client.chat.completions.create(
        model=srv.name, messages=msgs, response_format=rf, temperature=0.8, seed=seed, max_tokens=300))
    for r in answers:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)
    assert len({r.choices[0].message.content for r in answers}) > 10


def test_json_object_answers_parse_on_50_seeds(srv):
    msgs = [{"role": "user", "content": "Describe a cat in a JSON object with the keys name, age and colour."}]
    answers = _seeds(50, lambda seed: srv.client.chat.completions.create(
        model=srv.name, messages=msgs, response_format={"type": "json_object"}, temperature=0.8, seed=seed,
        max_tokens=300))
    for r in answers:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert len({r.choices[0].message.content for r in answers}) > 10


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
