"""Mixture-of-experts routing (kernels/cpu/moe.py) against its NumPy twins, and what a bad
qwen3moe file gets. The whole block against llama.cpp: tests/test_oracle.py (qwen3moe entries)."""
import numpy as np
import pytest
from edgellm.kernels import cpu
from gguf import GGMLQuantizationType as GGMLType

import edgellm
from edgellm.errors import GGUFError
from edgellm.synthetic import write_synthetic_gguf

moe = cpu._import("moe")
F32 = np.float32


@pytest.mark.parametrize("n_tok, n", [(1, 256), (1, 100), (4, 256), (3, 100), (2, 40)])
def test_router_logits_are_the_numpy_twins(n_tok, n):
    rng = np.random.default_rng(n_tok * 1000 + n)
    w = rng.standard_normal((24, n)).astype(F32)
    x = rng.standard_normal((n_tok, n)).astype(F32)
    out = np.empty((n_tok, 24), F32)
    moe.router_logits(w, x, out)
    assert np.array_equal(out, moe.router_logits_ref(w, x))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


def test_a_batch_of_tokens_takes_another_order_than_one_token():
    """llama.cpp's router product for one token (vec_dot_f32) and for a batch (tinyBLAS) differ in
    their last bits: the kernels keep both."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 2048)).astype(F32)
    x = rng.standard_normal((2, 2048)).astype(F32)
    one, two = np.empty((1, 128), F32), np.empty((2, 128), F32)
    moe.router_logits(w, x[:1], one)
    moe.router_logits(w, x, two)
    assert not np.array_equal(one[0], two[0])
    np.testing.assert_allclose(one[0], two[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [8, 12, 128])
def test_expert_probs_are_a_softmax(n):
    rng = np.random.default_rng(n)
    logits = (3 * rng.standard_normal((5, n))).astype(F32)
    p = moe.expert_probs(logits)
    assert p.dtype == F32
    e = np.exp(logits.astype(np.float64) - logits.max(1, keepdims=True))
    np.testing.assert_allclose(p, e / e.sum(1, keepdims=True), rtol=2e-6, atol=1e-8)


def test_route_takes_the_k_best_most_probable_first_and_renormalises():
    probs = np.array([[0.1, 0.4, 0.05, 0.3, 0.15], [0.2, 0.2, 0.2, 0.3, 0.1]], F32)
    ids, w = moe.route(probs, 3, norm=True)
    assert ids.tolist() == [[1, 3, 4], [3, 0, 1]]  # a tie: the lower index first
    np.testing.assert_allclose(w.sum(1), 1.0, rtol=1e-6)
    assert np.array_equal(w[0], (probs[0, [1, 3, 4]] / F32(0.85)).astype(F32))
    ids, w = moe.route(probs, 2, norm=False)
    assert np.array_equal(w, np.take_along_axis(probs, ids, 1))
    tiny = np.full((1, 4), 1e-6, F32)  # the sum is clamped at 2^-14
    _, w = moe.route(tiny, 2, norm=True)
    assert np.array_equal(w[0], (tiny[0, :2] / F32(2.0 ** -14)).astype(F32))


def _moe_file(tmp_path, **hparams):
    return write_synthetic_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                                n_ff=128, n_vocab=384, ggml_type=GGMLType.Q8_0, hparams=hparams)


@pytest.mark.parametrize("hparams, words", [
    ({"expert_used_count": 9}, "expert_used_count"),
    ({"expert_used_count": 0}, "expert_used_count"),
])
def test_a_bad_expert_count_is_a_clear_error(tmp_path, hparams, words):
    with pytest.raises(GGUFError) as e:
        edgellm.load(_moe_file(tmp_path, **hparams))
    assert words in str(e.value)


def test_an_expert_tensor_of_the_wrong_shape_is_a_clear_error(tmp_path):
    """A file whose metadata says wider experts than its tensors hold."""
    path = _moe_file(tmp_path)
    patched = path.read_bytes().replace(
        b"qwen3moe.expert_feed_forward_length" + np.uint32(4).tobytes() + np.uint32(64).tobytes(),
        b"qwen3moe.expert_feed_forward_length" + np.uint32(4).tobytes() + np.uint32(32).tobytes())
    assert patched != path.read_bytes()
    path.write_bytes(patched)
    with pytest.raises(GGUFError) as e:
        edgellm.load(path)
    assert "ffn_gate_exps" in str(e.value) and "corrupt" in str(e.value)


def test_sequences_decoded_together_get_their_solo_tokens(tmp_path):
    """The many-sequence engine on a mixture-of-experts file: batch-invariant, each sequence's
    greedy tokens are its own alone (the router and experts see one token at a time)."""
    path = write_synthetic_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=2, n_embd=128, n_head=2,
                                n_head_kv=1, n_ff=256, n_vocab=384, ggml_type=GGMLType.Q8_0,
                                hparams={"expert_count": 16, "expert_used_count": 4})
    prompts = [[1, 45, 120, 7, 300], [31, 200, 99], [5, 64, 128, 250, 17, 3], [333, 80]]
    kw = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    with edgellm.load(path, n_seq=4, batch_invariant=True) as m:
        solo = [[c.token for c in m.generate(t, **kw)] for t in prompts]
        together = [[c.token for c in r] for r in [m.submit(t, **kw) for t in prompts]]
    assert together == solo
    assert len({tuple(s) for s in solo}) == len(prompts)


def test_bench_counts_the_experts_a_token_reads(tmp_path):
    from edgellm.commands.bench import weight_bytes
    from edgellm.config import ModelConfig
    from edgellm.gguf_file import GGUFFile

    path = _moe_file(tmp_path, expert_count=8, expert_used_count=2)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    experts = sum(t.nbytes for n, t in gf.tensors.items() if n.endswith("_exps.weight"))
    assert experts > 0 and weight_bytes(gf, cfg) == weight_bytes(gf) - experts + experts // 4


def test_the_shared_experts_gate_is_a_sigmoid():
    x = np.array([[-8.0], [-0.5], [0.0001], [1.5], [9.0]], F32)
    gate = moe.silu_scalar(x) / x  # qwen2moe's sigmoid, as llama.cpp's graph computes it
    np.testing.assert_allclose(gate, 1 / (1 + np.exp(-x.astype(np.float64))), rtol=3e-7)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q6_K", "Q4_0", "F16"])
def test_linear_rows_gives_each_row_its_one_token_bits(qtype):
    """The expert products' rows alone (CPUBackend.linear_rows: one conversion of the batch, then
    the one-token kernel per row) against one-token products row by row."""
    from edgellm.kernels.cpu.backend import CPUBackend, QMatrix
    from quant_blocks import random_rows

    t = GGMLType[qtype]
    raw = random_rows(t, 24, 512, seed=5)
    w = QMatrix(int(t), raw, 24, 512, "w")
    x = np.random.default_rng(1).standard_normal((11, 512)).astype(F32)
    b = CPUBackend(threads=2)
    out = np.empty((11, 24), F32)
    b.linear_rows([w], x, [out])
    one = np.empty((1, 24), F32)
    for r in range(11):
        b.linear(w, x[r:r + 1], one)
        assert np.array_equal(out[r], one[0])


@pytest.mark.parametrize("n, k, norm", [(8, 2, True), (12, 3, False), (128, 8, True), (40, 8, False)])
def test_the_routing_kernel_is_its_numpy_twins(n, k, norm):
    rng = np.random.default_rng(n + k)
    logits = (2 * rng.standard_normal((9, n))).astype(F32)
    logits[0, :4] = logits[0, 4]  # a tie: the lower index first
    ids, w = moe.route_logits(logits, k, norm)
    ref_ids, ref_w = moe.route(moe.expert_probs(logits), k, norm)
    assert np.array_equal(ids, ref_ids) and np.array_equal(w, ref_w)


def test_every_expert_is_resident_after_load(tmp_path):
    """With the arena (use_mmap=False) each expert's matrix is copied or packed there at load, not
    at its first use mid-generation; the logits are the mapped model's bit for bit."""
    path = write_synthetic_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=2, n_embd=256, n_head=2,
                                n_head_kv=1, n_ff=256, n_vocab=384, ggml_type=GGMLType.Q4_K,
                                hparams={"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256},
                                tensor_types={f"blk.{i}.ffn_down_exps.weight": GGMLType.Q8_0 for i in range(2)})
    copied = edgellm.load(path, n_ctx=64, use_mmap=False)
    mapped = edgellm.load(path, n_ctx=64, use_mmap=True)
    cpu = copied.runtime.backends["cpu"]
    chunks = [np.frombuffer(c, np.uint8) for c in cpu.arena._chunks]
    experts = [w for L in copied.runtime.model.blocks for name in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
               for w in getattr(L, name)]
    assert len(experts) == 2 * 3 * 8
    for w in experts:
        if w.ggml_type == GGMLType.Q4_K:  # packed by eight into the arena at load (bound then)
            assert id(w) in cpu._bound and any(np.shares_memory(cpu._bound[id(w)][1].packed, c) for c in chunks)
        else:
            assert w.ggml_type == GGMLType.Q8_0 and any(np.shares_memory(w.data, c) for c in chunks)
    tokens = [1, 45, 120, 7, 300, 31]
    np.testing.assert_array_equal(copied.logits(tokens), mapped.logits(tokens))


def test_the_fused_expert_decode_is_the_products_one_by_one(tmp_path, monkeypatch):
    """CPUBackend.moe_decode (all experts of a Q4_K tensor packed in one array, two parallel
    kernels) gives the bits of the experts' products one at a time."""
    from edgellm.kernels.cpu.backend import CPUBackend

    path = write_synthetic_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=2, n_embd=256, n_head=2,
                                n_head_kv=1, n_ff=256, n_vocab=384, ggml_type=GGMLType.Q4_K,
                                hparams={"expert_count": 16, "expert_used_count": 4, "expert_feed_forward_length": 256})
    calls = []
    fused = CPUBackend.moe_decode
    monkeypatch.setattr(CPUBackend, "moe_decode", lambda self, *a: calls.append(fused(self, *a)) or calls[-1])
    kw = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    with edgellm.load(path, n_ctx=64) as m:
        tokens = [c.token for c in m.generate([1, 45, 120, 7], **kw)]
    assert len(calls) >= 2 * 15 and all(calls)  # every decode step of both layers took the fused path
    monkeypatch.setattr(CPUBackend, "moe_decode", lambda self, *a: False)
    with edgellm.load(path, n_ctx=64) as m:
        assert [c.token for c in m.generate([1, 45, 120, 7], **kw)] == tokens


def test_q6_k_down_experts_in_the_fused_decode_are_the_products_one_by_one(tmp_path, monkeypatch):
    """A Q4_K_M-style file (Q6_K down experts): the down rows of the chosen experts in one parallel
    kernel over every expert's rows in one array give the bits of the products one expert at a
    time (logprobs of 16 decode steps equal), mapped and resident."""
    from edgellm.kernels.cpu.backend import CPUBackend

    n_layer = 2
    path = write_synthetic_gguf(tmp_path / "moe.gguf", arch="qwen3moe", n_layer=n_layer, n_embd=256, n_head=2,
                                n_head_kv=1, n_ff=256, n_vocab=384, ggml_type=GGMLType.Q4_K,
                                hparams={"expert_count": 16, "expert_used_count": 4, "expert_feed_forward_length": 512},
                                tensor_types={f"blk.{i}.ffn_down_exps.weight": GGMLType.Q6_K for i in range(n_layer)})
    q6k = []
    real = moe.decode_down_q6k
    monkeypatch.setattr(moe, "decode_down_q6k", lambda *a: q6k.append(1) or real(*a))
    kw = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "cache_prompt": False, "logprobs": 2}

    def answer(**load):
        with edgellm.load(path, n_ctx=64, **load) as m:
            return [(c.token, c.logprob, tuple(t for t in c.top_logprobs)) for c in m.generate([1, 45, 120, 7], **kw)]

    fused = answer(use_mmap=True)
    assert len(q6k) >= n_layer * 15
    assert answer(use_mmap=False) == fused
    monkeypatch.setattr(CPUBackend, "moe_decode", lambda self, *a: False)
    n = len(q6k)
    assert answer(use_mmap=True) == fused
    assert len(q6k) == n  # the products one by one this time
