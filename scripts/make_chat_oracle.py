"""Write tests/data/chat_<model>.json: chats (with tools, tool calls and tool results) rendered by
llama-server --jinja's /apply-template (dev only; llama.cpp's tools are never an edgellm dependency).

    python scripts/make_chat_oracle.py --llama-bin DIR [--models qwen2.5-coder-0.5b,smollm2-135m]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _call(i: int, name: str, args: str) -> dict:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}


CASES = [
    {"messages": [{"role": "user", "content": "Hello!"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "How are you?"}]},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER]},
    {"messages": [{"role": "system", "content": "You help with weather."},
                  {"role": "user", "content": "Weather in Oslo, and the time?"}], "tools": [WEATHER, TIME]},
    {"messages": [{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": "",
                   "tool_calls": [_call(0, "get_weather", '{"city": "Paris", "unit": "celsius"}')]},
                  {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21}'}],
     "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "Weather in Oslo and Rome?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [_call(0, "get_weather", '{"city": "Oslo", "unit": "celsius"}'),
                                  _call(1, "get_weather", '{"city": "Rome", "unit": "celsius"}')]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "5 C"},
                  {"role": "tool", "tool_call_id": "call_1", "content": "19 C"}],
     "tools": [WEATHER]},
    {"messages": [{"role": "user", "content": "Time?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [_call(0, "get_time", "{}")]},
                  {"role": "tool", "tool_call_id": "call_0", "content": "12:00"},
                  {"role": "assistant", "content": "It is noon."},
                  {"role": "user", "content": "Thanks"}],
     "tools": [TIME]},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_all(server: Path, model: Path) -> list[dict]:
    port = _free_port()
    proc = subprocess.Popen([str(server), "-m", str(model), "--jinja", "--port", str(port), "-c", "512", "-t", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise SystemExit(f"llama-server did not start for {model}")
                time.sleep(0.5)
        out = []
        for case in CASES:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/apply-template", data=json.dumps(case).encode(),
                                         headers={"Content-Type": "application/json"})
            prompt = json.loads(urllib.request.urlopen(req, timeout=30).read())["prompt"]
            out.append({**case, "prompt": prompt})
        return out
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_BIN", ""), help="folder with llama-server")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,smollm2-135m")
    args = ap.parse_args()
    from edgellm.fetch import model_path

    server = Path(args.llama_bin) / "llama-server"
    for name in args.models.split(","):
        cases = render_all(server, model_path(name))
        out = DATA / f"chat_{name}.json"
        out.write_text(json.dumps({"model": name, "source": "llama-server 0.3.36 --jinja /apply-template",
                                   "cases": cases}, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {out} ({len(cases)} chats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
