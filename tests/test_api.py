"""The public Python API on the real default model (SmolLM2-135M-Instruct Q4_1)."""
from __future__ import annotations

import numpy as np
import pytest

import edgellm
from edgellm.errors import InvalidArgumentError

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def model(smollm2_path):
    return edgellm.load(smollm2_path, n_ctx=512, n_batch=64)


def test_model_surface(model):
    assert model.n_vocab == 49152 and model.n_ctx == 512
    assert model.metadata["general.architecture"] == "llama"
    assert model.plan.n_gpu_layers == 0 and set(model.plan.layers) == {"cpu"} and len(model.plan.layers) == 30


def test_eval_and_logits_agree(model):
    ids = model.tokenize("The capital of France is")
    all_logits = model.logits(ids)
    assert all_logits.shape == (len(ids), 49152) and all_logits.dtype == np.float32
    model.reset()
    last = model.eval(ids)
    # eval's head is a matvec with 8-bit activations (like llama.cpp), logits' a batched product
    # in float32: they agree to the activation-quantization error, not bit for bit
    assert kl(all_logits[-1], last) < 0.01 and last.argmax() == all_logits[-1].argmax()
    # eval appends: continuing with one token equals a fresh run over the longer sequence
    paris = int(last.argmax())
    assert model.detokenize([paris]).strip() == "Paris"
    nxt = model.eval([paris])
    again = model.logits(ids + [paris])[-1]
    assert kl(again, nxt) < 0.01 and nxt.argmax() == again.argmax()


def kl(p_logits, q_logits) -> float:
    lp = p_logits - np.logaddexp.reduce(p_logits.astype(np.float64))
    lq = q_logits - np.logaddexp.reduce(q_logits.astype(np.float64))
    return float((np.exp(lp) * (lp - lq)).sum())


def test_greedy_generate_and_stats(model):
    chunks = list(model.generate("The capital of France is", max_tokens=8, temperature=0))
    text = "".join(c.text for c in chunks)
    assert text.startswith(" Paris")
    assert len(chunks) <= 8 and all(isinstance(c.token, int) for c in chunks)
    s = model.stats
    assert s.prompt_tokens == len(model.tokenize("The capital of France is", parse_special=True))
    assert s.gen_tokens == len(chunks) and s.ttft_s > 0 and s.prompt_tps > 0
    if s.gen_tokens > 1:
        assert s.gen_tps > 0 and s.tpot_ms > 0 and "cpu" in s.device_ms
    assert s.n_past == s.prompt_tokens + s.gen_tokens - 1  # the last sampled token is not evaluated
    assert s.memory["cpu"]["weights"] == model.gf.file_size - model.gf.data_offset - _padding(model.gf)


def _padding(gf):
    return gf.file_size - gf.data_offset - sum(t.nbytes for t in gf.tensors.values())


def test_seed_reproducible_and_sampling_varies(model):
    kw = dict(max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123)
    a = [c.token for c in model.generate("Once upon a time", **kw)]
    b = [c.token for c in model.generate("Once upon a time", **kw)]
    assert a == b
    outs = {tuple(c.token for c in model.generate("Once upon a time", **{**kw, "seed": s})) for s in range(4)}
    assert len(outs) > 1


def test_stop_string_and_ignore_eos(model):
    text = "".join(c.text for c in model.generate("1, 2, 3, 4,", max_tokens=20, temperature=0, stop=["7"]))
    assert "7" not in text and "5" in text and "6" in text
    n = sum(1 for _ in model.generate("Hi", max_tokens=5, temperature=0, ignore_eos=True))
    assert n == 5


def test_chat_stops_at_end_of_turn(model):
    chunks = list(model.chat([{"role": "user", "content": "What is 2+2? Answer with one number."}],
                             max_tokens=40, temperature=0))
    assert chunks[-1].finish_reason == "stop"
    assert model.tokenizer.is_eog(chunks[-1].token)
    assert "4" in "".join(c.text for c in chunks)
    assert "<|im_end|>" not in "".join(c.text for c in chunks)


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1),
                                dict(min_p=2), dict(repeat_penalty=0), dict(max_tokens=-3)])
def test_invalid_sampling_values(model, kw):
    with pytest.raises(InvalidArgumentError):
        model.generate("hi", **kw)


def test_load_errors(tmp_path):
    with pytest.raises(edgellm.EdgeLLMError, match="no such file"):
        edgellm.load(tmp_path / "missing.gguf")
    with pytest.raises(edgellm.EdgeLLMError, match="n_ctx"):
        edgellm.load(tmp_path / "missing.gguf", n_ctx=0)


def test_logits_from_a_position_skip_the_head_for_earlier_rows(model):
    """logits(ids, first=k) is logits(ids)[k:] bit for bit (across a batch boundary too)."""
    ids = [int(t) for t in np.random.default_rng(1).integers(100, 40000, size=100)]  # n_batch 64: 2 batches
    full = model.logits(ids)
    np.testing.assert_array_equal(model.logits(ids, first=20), full[20:])
    np.testing.assert_array_equal(model.logits(ids, first=80), full[80:])
    with pytest.raises(edgellm.EdgeLLMError, match="first"):
        model.logits(ids, first=100)


@pytest.mark.parametrize("call, match", [
    (lambda m: m.eval([2**63]), "outside the vocabulary"),
    (lambda m: m.eval(None), "list of token ids"),
    (lambda m: m.eval(["a"]), "integers"),
    (lambda m: m.eval([1.7]), "integers"),  # was silently token 1
    (lambda m: m.logits("abc"), "list of token ids"),
    (lambda m: m.detokenize("abc"), "list of token ids"),
    (lambda m: list(m.generate(None)), "str or a list of token ids"),
    (lambda m: list(m.generate("Hi", stop=[1])), "stop"),
    (lambda m: list(m.generate("Hi", seed="x")), "seed"),
    (lambda m: list(m.generate("Hi", temperature="hot")), "temperature"),
    (lambda m: list(m.generate("Hi", max_tokens="x")), "max_tokens"),
    (lambda m: list(m.chat([{"role": "user", "content": "Hi"}], foo=1)), "unknown argument 'foo'"),
])
def test_api_arguments_of_the_wrong_type_are_clear_errors(model, call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call(model)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_ctx="abc"), "n_ctx"), (dict(n_ctx=float("nan")), "n_ctx"), (dict(gpu_layers="abc"), "gpu_layers"),
    (dict(threads=0), "threads"), (dict(n_seq=True), "n_seq"), (dict(kv_size=-5), "kv_size"),
    (dict(flash_attn="maybe"), "flash_attn"), (dict(flash_attn="on", kv_type="f32"), "f32"),
])
def test_load_arguments_are_checked_before_anything_loads(smollm2_path, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        edgellm.load(smollm2_path, **kwargs)
    with pytest.raises(InvalidArgumentError, match="path"):
        edgellm.load(12345)


def test_a_stop_string_is_one_string_and_none_is_no_stop(model):
    text = "".join(c.text for c in model.generate("1, 2, 3, 4, 5, 6, 7,", max_tokens=12, temperature=0))
    cut = text[len(text) // 2:][:3]
    assert cut and "".join(c.text for c in model.generate("1, 2, 3, 4, 5, 6, 7,", max_tokens=12, temperature=0,
                                                          stop=cut)) == text[:text.index(cut)]
    assert len(list(model.generate("Hi", max_tokens=3, temperature=0, stop=None, ignore_eos=True))) == 3
