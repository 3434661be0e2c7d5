"""Tool calls and structured output: the same requests against `edgellm serve` and llama.cpp's
`llama-server --jinja` on the same file, compared by how each answer parses.

Greedy requests (temperature 0; both servers compute the same logits bit for bit, llama-server with
-fa off) must parse the same way: the same finish reason, the same calls (name and parsed arguments),
the same JSON value for structured output; text answers are compared as text. Sampled requests
(temperature 0.8, --seeds seeds; the two samplers draw differently) report how many answers parse and
validate on each side. Prints a Markdown table; --json writes the raw answers.

    python scripts/vs_llamacpp/tools_vs_llama_server.py MODEL.gguf [--llama-bin DIR]

Dev tool (needs llama-server, jsonschema and the openai client), never imported by the package.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serve  # starts either server
import llamacpp

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ITEM = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "kind": {"enum": ["book", "pen", "cup"]}},
        "required": ["title", "qty", "kind"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 1, "maxItems": 3},
                                          "paid": {"type": "boolean"}},
         "required": ["items", "paid"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BOTH = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
HELLO = [{"role": "user", "content": "Say hello in French."}]
SHOP = [{"role": "user", "content": "An order of a few things from a stationery shop, as JSON."}]
CAT = [{"role": "user", "content": "Describe a cat in a JSON object with the keys name, age and colour."}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# name -> (request fields, what the answer must be: "call" / "text" / a JSON schema / "object")
CASES = {
    "required call": ({"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}, "call"),
    "auto, a call": ({"messages": ASK, "tools": [WEATHER], "tool_choice": "auto"}, "call"),
    "auto, two tools": ({"messages": BOTH, "tools": [WEATHER, TIME], "tool_choice": "auto",
                         "parallel_tool_calls": True}, "call"),
    "auto, no call wanted": ({"messages": HELLO, "tools": [WEATHER], "tool_choice": "auto"}, "any"),
    "named tool": ({"messages": ASK, "tools": [WEATHER], "tool_choice": NAMED}, "call"),
    "none": ({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"}, "text"),
    "json_schema": ({"messages": SHOP, "response_format": {"type": "json_schema", "json_schema": {
        "name": "order", "schema": ORDER, "strict": True}}}, ORDER),
    "json_object": ({"messages": CAT, "response_format": {"type": "json_object"}}, "object"),
}
SAMPLED = ("required call", "json_schema", "json_object")


def parsed(choice, want) -> dict:
    """How an answer parses: {"finish", "calls": [(name, args)], "json" | "text", "valid"}."""
    msg = choice.message
    out = {"finish": choice.finish_reason, "calls": [], "valid": True}
    for c in msg.tool_calls or []:
        try:
            args = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            args, out["valid"] = c.function.arguments, False
        out["calls"].append((c.function.name, args))
    text = msg.content or ""
    if isinstance(want, dict) or want == "object":
        try:
            out["json"] = json.loads(text)
            if isinstance(want, dict):
                jsonschema.validate(out["json"], want)
            else:
                out["valid"] = isinstance(out["json"], dict)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            out["json"], out["valid"] = text, False
    else:
        out["text"] = text.strip()
        if want == "call":
            tools = {"get_weather": WEATHER, "get_time": TIME}
            out["valid"] = bool(out["calls"]) and all(
                n in tools and _validates(a, tools[n]["function"]["parameters"]) for n, a in out["calls"])
        elif want == "text":
            out["valid"] = not out["calls"] and bool(out["text"])
    return out


def _validates(args, schema) -> bool:
    try:
        jsonschema.validate(args, schema)
        return True
    except jsonschema.ValidationError:
        return False


def run_side(kind: str, args) -> dict:
    proc, url, model = bench_serve.start(kind, args, 1, llama_extra=("--jinja", "-fa", "off"))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        greedy = {}
        for name, (fields, want) in CASES.items():
            r = client.chat.completions.create(model=model, temperature=0, max_tokens=args.max_tokens, **fields)
            greedy[name] = parsed(r.choices[0], want)
        # the round trip: one fixed call answered by a tool message, so both sides see the same prompt
        call = {"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
        follow = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps({"temp_c": 21, "sky": "clear"})}]
        r = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER], temperature=0,
                                           max_tokens=args.max_tokens)
        greedy["tool result round trip"] = parsed(r.choices[0], "text")
        sampled = {}
        for name in SAMPLED:
            fields, want = CASES[name]
            ok = 0
            for seed in range(args.seeds):
                r = client.chat.completions.create(model=model, temperature=0.8, seed=seed,
                                                   max_tokens=args.max_tokens, **fields)
                p = parsed(r.choices[0], want)
                ok += p["valid"] and p["finish"] in ("stop", "tool_calls")
            sampled[name] = ok
        return {"greedy": greedy, "sampled": sampled}
    finally:
        proc.terminate()
        proc.wait(30)


def same(a: dict, b: dict) -> bool:
    keys = ("finish", "calls", "json", "text")
    return all(a.get(k) == b.get(k) for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-c", "--ctx", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=20, help="sampled requests per case and server")
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None, help="write both sides' answers here")
    llamacpp.add_argument(ap)
    args = ap.parse_args()
    sides = {kind: run_side(kind, args) for kind in ("edgellm", "llama-server")}
    e, ls = sides["edgellm"], sides["llama-server"]
    print(f"\n{Path(args.model).name}: greedy (temperature 0)\n")
    print("| request | edgellm | llama-server --jinja | same parse |\n|---|---|---|---|")
    for name in e["greedy"]:
        a, b = e["greedy"][name], ls["greedy"][name]
        show = lambda p: (f"{p['finish']}, " + (", ".join(n for n, _ in p["calls"]) or "text")
                          + ("" if p["valid"] else ", INVALID"))
        print(f"| {name} | {show(a)} | {show(b)} | {'yes' if same(a, b) else 'no'} |")
    print(f"\nsampled (temperature 0.8, {args.seeds} seeds): answers that parse and validate\n")
    print("| request | edgellm | llama-server --jinja |\n|---|---|---|")
    for name in SAMPLED:
        print(f"| {name} | {e['sampled'][name]}/{args.seeds} | {ls['sampled'][name]}/{args.seeds} |")
    for name in e["greedy"]:
        if not same(e["greedy"][name], ls["greedy"][name]):
            print(f"\n{name}:\n  edgellm:      {e['greedy'][name]}\n  llama-server: {ls['greedy'][name]}")
    if args.json:
        args.json.write_text(json.dumps(sides, indent=1, default=str))


if __name__ == "__main__":
    main()
