"""Hostile input past the loader: shapes the CPU kernels are handed, prompts far longer than the
context, and the memory map of a dropped model."""
from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import edgellm
from edgellm.backend import QMatrix
from edgellm.errors import ContextFullError, EdgeLLMError, ModelShapeError
from edgellm.fetch import model_path
from edgellm.gguf_file import GGUFFile
from edgellm.tokenizer import Tokenizer

MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}


@pytest.fixture(scope="module")
def smol():
    m = edgellm.load(model_path("smollm2-135m"), n_ctx=256, threads=1)
    yield m
    m.close()


def _fresh_block(m, **weights):
    """Block 0 of m with some weights replaced, the backend's bound matrices and fused plans
    forgotten (so the next step binds and plans again)."""
    decoder = m.runtime.model
    original = decoder.blocks[0]
    block = dataclasses.replace(original) if dataclasses.is_dataclass(original) else type(original)(**vars(original))
    for name, w in weights.items():
        setattr(block, name, w)
    decoder.blocks[0] = block
    for b in {id(b): b for b in decoder.layer_backends}.values():
        b._fused.clear()
        b._bound.clear()
    return original


def _restore(m, original):
    m.runtime.model.blocks[0] = original
    for b in m.runtime.model.layer_backends:
        b._fused.clear()
        b._bound.clear()


# --- 1. the kernels are never handed a matrix that disagrees with its activation ---------------
@pytest.mark.real
@pytest.mark.parametrize("case", ["rows", "width", "bytes"])
def test_decode_block_refuses_weights_that_do_not_fit_the_activations(smol, case):
    """The fused one-token block takes row counts and widths from the arrays: a q matrix with
    too few rows, an output projection with rows wider than the attention output, or a matrix
    whose bytes are not n_rows x n_cols must be an EdgeLLMError before the kernel runs (without
    the check these three run silently, reading and writing the wrong elements)."""
    L = smol.runtime.model.blocks[0]
    q, k, down = L.attn_q, L.attn_k, L.ffn_down
    bad = {
        # attn_k's 192 rows where attn_q's 576 belong (the kernel would fill a third of q)
        "rows": {"attn_q": dataclasses.replace(k, name="blk.0.attn_q.weight")},
        # ffn_down's rows of 1536 where attn_output's of 576 belong (read as 576-wide)
        "width": {"attn_output": dataclasses.replace(down, name="blk.0.attn_output.weight")},
        # q's shape with only half its rows of bytes (the kernel would take 288 rows)
        "bytes": {"attn_q": dataclasses.replace(q, data=q.data[: q.n_rows // 2])},
    }[case]
    original = _fresh_block(smol, **bad)
    try:
        smol.reset()
        with pytest.raises(ModelShapeError) as err:
            smol.eval([1])
        msg = str(err.value)
        assert ("attn_q" in msg or "attn_output" in msg) and "\n" not in msg
        # the prompt path (no fused block) refuses it too
        smol.reset()
        with pytest.raises(EdgeLLMError):
            smol.eval([1, 2, 3])
    finally:
        _restore(smol, original)
    smol.reset()
    assert np.isfinite(smol.eval([1, 2])).all()  # the model works again with its own weights


@pytest.mark.real
def test_shape_checks_cost_nothing_per_token(smol):
    """The fused block's check runs when it meets a new scratch or cache, not per token: count
    the calls over 20 decode steps."""
    import edgellm.validate as validate

    calls = []
    real = validate.check_fused_block
    validate.check_fused_block = lambda *a: (calls.append(1), real(*a))[1]
    try:
        smol.reset()
        smol.eval([1])
        first = len(calls)
        for t in range(20):
            smol.eval([2 + t])
    finally:
        validate.check_fused_block = real
    n_layer = smol.config.n_layer
    assert first == n_layer  # checked once per block, against the first step's scratch and cache
    assert len(calls) == first  # and never again


# --- 2. a prompt that cannot fit the context fails without being tokenized in full -------------
@pytest.fixture(scope="module", params=list(MODELS))
def tokenizer(request):
    md = GGUFFile(model_path(MODELS[request.param])).metadata
    return request.param, Tokenizer.from_metadata(md)


def _long_texts(name):
    prose = ("The quick brown fox jumps over the lazy dog. 1234567 Zürich naïve café — “quotes” 日本語 "
             "emoji 😀, <|im_start|>user\ntabs\tand  spaces   <start_of_turn> end.\n")
    code = "def f(x):\n    return [i ** 2 for i in range(x)]  # comment\n" * 3
    return [prose * 40, code * 30, (prose + code) * 25, "a" * 5000, " " * 3000 + "x", "\n" * 2000]


@pytest.mark.real
def test_limit_gives_the_same_ids_or_fails(tokenizer):
    """For a text within the limit the ids are byte for byte those without a limit; past it, the
    error; at exactly the count, no error."""
    name, tok = tokenizer
    assert not tok._may_drop(_long_texts(name)[0])  # real vocabularies and text: the character bound applies
    for text in _long_texts(name):
        for special in (False, True):
            full = tok.tokenize(text, add_special=True, parse_special=special)
            n = len(full)
            assert n > 20
            for limit in (n, n + 1, 4 * n):
                assert tok.tokenize(text, add_special=True, parse_special=special, limit=limit) == full
            for limit in (n - 1, n // 2, 1):
                with pytest.raises(ContextFullError):
                    tok.tokenize(text, add_special=True, parse_special=special, limit=limit)


@pytest.mark.real
def test_a_huge_text_fails_at_once(tokenizer):
    name, tok = tokenizer
    text = "All work and no play makes Jack a dull boy. " * (20 * 2**20 // 44)  # 20 MB
    t0 = time.process_time()
    with pytest.raises(ContextFullError):
        tok.tokenize(text, add_special=True, parse_special=True, limit=4096)
    assert time.process_time() - t0 < 1.0
    # just under the character bound: tokenized, but stopped at the limit
    text = text[: 4096 * tok.max_token_chars]
    t0 = time.process_time()
    with pytest.raises(ContextFullError):
        tok.tokenize(text, add_special=True, parse_special=True, limit=4096)
    assert time.process_time() - t0 < 5.0


def test_a_vocabulary_that_drops_bytes_is_tokenized_in_full():
    """Byte-level BPE drops the bytes of a piece that is no token: the character bound does not
    hold for such a vocabulary, so the limit is found by counting (same answers)."""
    tokens = ["<|endoftext|>", "a", "b", "c", "Ġ", "ab", "bc", "Ġa", "Ġab", "abc"]
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": np.array([3] + [1] * (len(tokens) - 1), np.int32),
          "tokenizer.ggml.merges": ["b c", "a b", "Ġ a", "Ġa b", "ab c"],
          "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}
    tok = Tokenizer.from_metadata(md)
    assert tok._may_drop("ab z")
    text = "ab " + "z" * 100  # 'z' is no token: 100 characters, no ids
    ids = tok.tokenize(text)
    assert len(ids) == 2 and len(text) > 3 * tok.max_token_chars
    assert tok.tokenize(text, limit=2) == ids
    with pytest.raises(ContextFullError):
        tok.tokenize(text, limit=1)


@pytest.mark.real
def test_generate_and_chat_refuse_a_50_mb_prompt_fast(smol):
    text = "All work and no play makes Jack a dull boy. " * (50 * 2**20 // 44)
    for call in (lambda: smol.generate(text, max_tokens=1), lambda: smol.chat([{"role": "user", "content": text}])):
        t0 = time.process_time()
        with pytest.raises(ContextFullError) as err:
            call()
        assert time.process_time() - t0 < 3.0
        assert "context holds 256" in str(err.value)
    assert [c.token for c in smol.generate("Hello", max_tokens=2, temperature=0)]  # still usable


@pytest.mark.real
def test_cli_refuses_a_50_mb_prompt_fast(tmp_path):
    text = "All work and no play makes Jack a dull boy. " * (50 * 2**20 // 44)
    src = tmp_path / "prompt.txt"
    src.write_text(text)
    with open(src) as f:
        r = subprocess.run([sys.executable, "-m", "edgellm.cli", "run", str(model_path("smollm2-135m")), "--raw",
                            "-c", "512", "-n", "2", "-v"], stdin=f, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "prompt is more than 512 tokens but the context holds 512" in r.stderr


# --- 5. dropping a model unmaps its file at once ------------------------------------------------
def _maps_of(path) -> int:
    target = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return sum(line.rstrip("\n").endswith(target) for line in f)


@pytest.mark.real
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc (Linux)")
def test_del_model_unmaps_the_file_without_the_cycle_collector():
    path = model_path("smollm2-135m")
    gc.collect()
    before_maps, before_fds = _maps_of(path), len(os.listdir("/proc/self/fd"))
    gc.disable()
    try:
        m = edgellm.load(path, n_ctx=64, threads=1)
        m.eval([1, 2])
        assert _maps_of(path) == before_maps + 1
        del m
        assert _maps_of(path) == before_maps  # unmapped by reference counting alone
        assert len(os.listdir("/proc/self/fd")) <= before_fds
        t = GGUFFile(path).tensor("output_norm.weight")  # the tensor keeps the bytes, not the file
        assert _maps_of(path) == before_maps + 1 and t.data.shape == (1, 576 * 4)
        del t
        assert _maps_of(path) == before_maps
        gf = GGUFFile(path)
        t = gf.tensor("output_norm.weight")
        gf.close()
        with pytest.raises(EdgeLLMError):
            t.data  # noqa: B018 - the file was closed: one clear error
    finally:
        gc.enable()


@pytest.mark.real
def test_huge_lists_of_token_ids_are_refused_before_each_id_is_checked(smol):
    ids = [1] * 20_000_000
    for call in (lambda: smol.eval(ids), lambda: smol.logits(ids), lambda: smol.generate(ids, max_tokens=1)):
        t0 = time.process_time()
        with pytest.raises(ContextFullError):
            call()
        assert time.process_time() - t0 < 0.5
    smol.reset()
    assert np.isfinite(smol.eval([1, 2])).all()
