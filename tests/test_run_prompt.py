"""`edgellm run -p` as a new user runs it: an instruct model answers the prompt through its chat
template, a base model (no template) completes it, `--raw` forces completion."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest


def edgellm(*args, stdin=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout)


def tokenizer_of(path):
    from edgellm.gguf_file import GGUFFile
    from edgellm.tokenizer import Tokenizer

    gf = GGUFFile(path)
    return gf.metadata, Tokenizer.from_metadata(gf.metadata)


def fed_tokens(stderr: str) -> int:
    """The prompt token count of the run's timing summary (what the model evaluated)."""
    return int(re.search(r"prompt (\d+) tok,", stderr).group(1))


@pytest.mark.real
def test_run_uses_the_chat_template_of_an_instruct_model(smollm2_path):
    from edgellm.chat import render_chat

    meta, tk = tokenizer_of(smollm2_path)
    prompt = "Write a haiku about memory."
    r = edgellm("run", str(smollm2_path), "-p", prompt, "-n", "24", "--temp", "0", "-c", "256", "-v")
    assert r.returncode == 0, r.stderr
    rendered = render_chat(meta["tokenizer.chat_template"], [{"role": "user", "content": prompt}],
                           bos_token="", eos_token="")
    assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")
    expect = tk.tokenize(rendered, add_special=True, parse_special=True)
    assert fed_tokens(r.stderr) == len(expect)
    assert f"prompt: chat, the file's chat template ({len(expect)} tokens)" in r.stderr
    # the answer is an answer: it does not end at once, and it is not the prompt's continuation
    assert len(r.stdout.split()) >= 5, r.stdout
    assert "<|im_start|>" not in r.stdout

    # a system prompt is the chat's first message
    r = edgellm("run", str(smollm2_path), "-p", prompt, "--system", "You are a poet.", "-n", "1",
                "--temp", "0", "-c", "256")
    assert r.returncode == 0, r.stderr
    with_system = render_chat(meta["tokenizer.chat_template"], [
        {"role": "system", "content": "You are a poet."}, {"role": "user", "content": prompt}],
        bos_token="", eos_token="")
    assert fed_tokens(r.stderr) == len(tk.tokenize(with_system, add_special=True, parse_special=True))


@pytest.mark.real
def test_run_raw_and_stdin(smollm2_path):
    meta, tk = tokenizer_of(smollm2_path)
    for flag in ("--raw", "--no-chat"):
        r = edgellm("run", str(smollm2_path), flag, "-p", "The capital of France is", "-n", "3", "--temp", "0",
                    "-c", "256", "-v")
        assert r.returncode == 0, r.stderr
        assert fed_tokens(r.stderr) == len(tk.tokenize("The capital of France is")) == 5
        assert "prompt: plain completion (--raw)" in r.stderr
        assert r.stdout.startswith(" Paris")
    # a piped prompt is the user's message too (its final newline dropped)
    r = edgellm("run", str(smollm2_path), "-n", "1", "--temp", "0", "-c", "256", stdin="Hello there\n")
    assert r.returncode == 0, r.stderr
    from edgellm.chat import render_chat

    rendered = render_chat(meta["tokenizer.chat_template"], [{"role": "user", "content": "Hello there"}],
                           bos_token="", eos_token="")
    assert fed_tokens(r.stderr) == len(tk.tokenize(rendered, add_special=True, parse_special=True))
    r = edgellm("run", str(smollm2_path), "--raw", "--system", "x", "-p", "hi", "-n", "1")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "--system needs a chat" in r.stderr


@pytest.mark.real
def test_run_completes_with_a_base_model(gemma3_path):
    meta, tk = tokenizer_of(gemma3_path)
    assert not meta.get("tokenizer.chat_template")
    prompt = "The capital of France is"
    r = edgellm("run", str(gemma3_path), "-p", prompt, "-n", "2", "--temp", "0", "-c", "128", "-v")
    assert r.returncode == 0, r.stderr
    assert fed_tokens(r.stderr) == len(tk.tokenize(prompt))
    assert "prompt: plain completion (the file has no chat template)" in r.stderr
    # --chat still forces a chat (ChatML, as llama.cpp falls back to)
    r = edgellm("run", str(gemma3_path), "--chat", "-p", prompt, "-n", "1", "--temp", "0", "-c", "128", "-v")
    assert r.returncode == 0, r.stderr
    assert "ChatML" in r.stderr and fed_tokens(r.stderr) > len(tk.tokenize(prompt)) + 4
