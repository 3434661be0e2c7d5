"""The first run's compile step: one progress line, and kernels compiled by worker processes that
the load then finds in the disk cache."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from edgellm.precompile import CompileProgress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_one_line_on_a_pipe():
    out = io.StringIO()
    p = CompileProgress(out)
    p.steps(0, 7)
    for name in ("matvec_q4_1", "decode_layers", "rope"):
        p(name)
        p.steps(1, 7)
    p.done()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"compiling kernels \(first run only\) \[-{24}\] 0/7 steps, 1 kernel, \d+ s", lines[0])
    assert re.fullmatch(r"compiled 3 kernels in \d+ s \(cached for the next runs\)", lines[1])


def test_progress_redraws_a_bar_on_a_terminal():
    out = Terminal()
    p = CompileProgress(out)
    p.steps(0, 4)
    p("a")
    p.steps(3, 4)
    p("b")
    frames = out.getvalue().split("\r\033[K")
    assert "\n" not in "".join(frames)  # one line, redrawn
    assert frames[-1].startswith("compiling kernels (first run only) [" + "#" * 18 + "-" * 6 + "] 3/4 steps, 2 kernels,")
    p.done()
    assert out.getvalue().endswith("\r\033[K" + out.getvalue().rsplit("\r\033[K", 1)[1]) \
        and out.getvalue().rsplit("\r\033[K", 1)[1].startswith("compiled 2 kernels in ")


def test_nothing_compiled_prints_nothing():
    out = io.StringIO()
    p = CompileProgress(out)
    p.steps(0, 3)
    p.steps(3, 3)
    p.done()
    assert out.getvalue() == ""


@pytest.mark.real
def test_groups_split_the_prompt_the_unfused_decode_and_the_fused_decode(smollm2_path, gemma3_path):
    from edgellm.kernels.cpu.warmup import open_model as _open
    from edgellm.kernels.cpu.warmup import step_groups, worker_shares
    from edgellm.kernels.cpu.warmup import PROMPT_TOKENS, SEQS_TOKENS

    cfg, _, model = _open(str(smollm2_path), 1)
    prompt, one, layers = step_groups(model, cfg)
    last = cfg.n_layer - 1
    # SmolLM2: every layer has the same types, so a layer of each kind is the first and the last;
    # the prompt batches and the short batch (a prompt's tail) go together
    assert prompt == [("block", 0, PROMPT_TOKENS, False), ("block", 0, SEQS_TOKENS, False),
                      ("block", last, PROMPT_TOKENS, False), ("block", last, PROMPT_TOKENS, True),
                      ("block", last, SEQS_TOKENS, False)]
    assert sorted(one, key=str) == sorted([("block", 0, 1, False), ("block", last, 1, False), ("head", PROMPT_TOKENS),
                                           ("head", 1), ("head", SEQS_TOKENS)], key=str)
    assert layers == [("layers", (0, last), 1)]
    # the fused decode step goes last, after the unfused one-token steps (whose kernels it calls)
    assert worker_shares([prompt, one, layers], 2) == [prompt, one + layers]
    assert worker_shares([prompt, one, layers], 1) == [prompt + one + layers]
    cfg, _, model = _open(str(gemma3_path), 1)
    steps = [s for g in step_groups(model, cfg) for s in g]
    assert len(steps) == len(set(steps)) and ("head", 1) in steps
    layers = [s for s in steps if s[0] == "layers"]  # a layer of each kind: both sliding kinds, global, last
    assert len(layers) == 1 and layers[0][2] == 1 and {cfg.swa_layers[il] for il in layers[0][1]} == {True, False}
    assert {s[1] for s in steps if s[0] == "block" and s[2] == 1} == set(layers[0][1])


@pytest.mark.real
def test_cold_run_compiles_in_workers_and_the_load_finds_them(smollm2_path, tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("EDGELLM_NO_PRECOMPILE", None)
    cmd = [sys.executable, "-m", "edgellm.cli", "run", str(smollm2_path), "-p", "Hi", "-n", "1", "-c", "128", "-v"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr
    workers = re.search(r"compile workers' CPU seconds: (.*)", r.stderr).group(1).split(", ")
    assert len(workers) == min(2, len(os.sched_getaffinity(0)))
    # one progress line and one summary: the load after the workers compiled nothing itself
    assert len(re.findall(r"^compiling kernels", r.stderr, re.M)) == 1, r.stderr
    assert len(re.findall(r"^compiled \d+ kernels in", r.stderr, re.M)) == 1, r.stderr
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compil" not in again.stderr, again.stderr


@pytest.mark.real
def test_the_first_run_answers_before_the_fused_kernel_is_compiled(smollm2_path, tmp_path):
    """The first run answers once the prompt's and the unfused decode step's kernels are compiled;
    its decode steps run the unfused kernels while a worker compiles the fused one, and give the
    answer the next run (fused, from the cache) gives, token for token."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env.pop("EDGELLM_NO_PRECOMPILE", None)
    cmd = [sys.executable, "-m", "edgellm.cli", "run", str(smollm2_path), "-p", "Name three colours.", "-n", "24",
           "--temp", "0", "-c", "256", "--ignore-eos"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stderr
    # the answer was complete while the fused kernel was still compiling: the command waited for it after
    assert "finishing the decode kernel's compile" in first.stderr, first.stderr
    assert first.stderr.index("prompt ") < first.stderr.index("finishing the decode kernel's compile")
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compil" not in again.stderr, again.stderr
    assert len(first.stdout.split()) >= 10 and first.stdout == again.stdout


def test_prepare_never_fails(tmp_path, monkeypatch):
    """A file the workers cannot read is left to the load, which reports it with its own message."""
    from edgellm.precompile import prepare

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    prepare(bad)  # no exception, no worker started (the file does not open)
    assert not (tmp_path / "numba" / "edgellm-models").exists()


DOWNLOAD_SCRIPT = r"""
import os, shutil, sys, time
from pathlib import Path
import edgellm.fetch as fetch
from edgellm.precompile import fetch_and_prepare

real, numba_dir = Path(sys.argv[1]), Path(os.environ["NUMBA_CACHE_DIR"])

def slow_download(m, target, *, quiet):
    # a download that lasts until the stand-in's decode kernel is in the disk cache (at most 20 min)
    deadline = time.monotonic() + 1200
    while not any("decode_layers" in p.name and p.suffix == ".nbi" for p in numba_dir.rglob("*")):
        assert time.monotonic() < deadline, "the stand-in compiled nothing during the download"
        time.sleep(0.5)
    print("decode kernel compiled during the download", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(real, target)

fetch._fetch = slow_download
print(fetch_and_prepare("smollm2-135m", verbose=True)[0])
"""


@pytest.mark.real
def test_kernels_compile_while_the_model_downloads(smollm2_path, tmp_path, monkeypatch):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), EDGELLM_CACHE=str(tmp_path / "cache"))
    env.pop("EDGELLM_NO_PRECOMPILE", None)
    r = subprocess.run([sys.executable, "-c", DOWNLOAD_SCRIPT, str(smollm2_path)], env=env, capture_output=True,
                       text=True, timeout=2400)
    assert r.returncode == 0, r.stderr
    assert "decode kernel compiled during the download" in r.stderr
    assert r.stdout.strip() == str(tmp_path / "cache" / "models" / smollm2_path.name)
    # after the download only what the stand-in did not cover is compiled (a cold cache: ~30; the
    # stand-in has the file's tensor types, so usually nothing, and then no progress line at all)
    said = re.search(r"compiled (\d+) kernels? in", r.stderr)
    assert (int(said.group(1)) if said else 0) <= 4, r.stderr
    # the file itself starts no worker (the stand-in has its types) and is remembered as compiled
    assert r.stderr.count("compile workers' CPU seconds") <= 1, r.stderr  # (the stand-in's, when it was still at work)
    from edgellm.precompile import _stamp

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba"))
    assert _stamp(tmp_path / "cache" / "models" / smollm2_path.name, "f16").exists()


def test_every_known_model_has_a_stand_in_that_opens(tmp_path):
    """The stand-in compiled during a download is a valid file of the model's architecture, whose
    warm-up has a decode and a prompt part (what the workers split), the prompt part with a short
    batch (a prompt's tail)."""
    from gguf import GGMLQuantizationType

    from edgellm.fetch import KNOWN_MODELS
    from edgellm.kernels.cpu.warmup import open_model as _open
    from edgellm.kernels.cpu.warmup import step_groups
    from edgellm.precompile import write_stand_in

    for name, known in KNOWN_MODELS.items():
        path = write_stand_in(known.stand_in, tmp_path / f"{name}.gguf")
        cfg, _, model = _open(str(path), 1)
        assert cfg.arch == known.stand_in.arch
        groups = step_groups(model, cfg)
        assert {s[2] for g in groups for s in g if s[0] == "block"} == {1, 3, 9}  # one token, a tail, a prompt
        assert [s[2] for g in groups for s in g if s[0] == "layers"] == [1]
        assert model.blocks[1].ffn_down.ggml_type == GGMLQuantizationType[known.stand_in.layers[-1][-1]]


def _types(path) -> tuple[str, set[tuple[str, ...]]]:
    """(the token embedding's type, the untied head's type or None, {the types of fetch.ROLES in a
    layer}) of a GGUF file."""
    from gguf import GGUFReader

    from edgellm.fetch import ROLES

    t = {x.name: x.tensor_type.name for x in GGUFReader(path).tensors}
    n_layer = sum(1 for k in t if k.endswith(".attn_q.weight"))
    return t["token_embd.weight"], t.get("output.weight"), {tuple(t[f"blk.{i}.{r}.weight"] for r in ROLES) for i in range(n_layer)}


@pytest.mark.real
@pytest.mark.parametrize("name, fixture", [("smollm2-135m", "smollm2_path"), ("gemma3-270m", "gemma3_path"),
                                           ("qwen2.5-coder-0.5b", "qwen05_path"),
                                           ("qwen2.5-coder-1.5b", "qwen15_path")])
def test_the_stand_in_has_the_real_files_tensor_types(name, fixture, request, tmp_path):
    """The kernels compiled for the stand-in are the real file's only if its tensors have the same
    types (decode_block is compiled per family of row types, the head per type)."""
    from edgellm.fetch import KNOWN_MODELS
    from edgellm.precompile import write_stand_in

    real = request.getfixturevalue(fixture)
    assert _types(write_stand_in(KNOWN_MODELS[name].stand_in, tmp_path / "s.gguf")) == _types(real)
