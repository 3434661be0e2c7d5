"""Whole-model checks on synthetic files of every architecture: the Numba CPU backend against the
NumPy reference backend, batched prefill against token-by-token decode, and hybrid CPU + stand-in
GPU placement against the pure CPU run."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgellm
from edgellm.kernels.cpu.backend import CPUBackend
from edgellm.backend_reference import ReferenceBackend
from edgellm.config import ModelConfig
from edgellm.gguf_file import GGUFFile
from edgellm.placement import make_plan
from edgellm.runtime import Runtime
from edgellm.synthetic import write_synthetic_gguf
from standin import StandInGPU

SHAPE = dict(n_layer=3, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320)
ARCH_SHAPE = {"smollm3": {"n_layer": 4}}  # its fourth layer is the first without RoPE
ARCHS = ["llama", "qwen2", "qwen3", "gemma3", "smollm3", "granite", "olmo2", "phi3", "gemma2"]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    cache = {}

    def make(arch, qtype=T.Q8_0, **kw):
        kw = {**ARCH_SHAPE.get(arch, {}), **kw}
        key = (arch, qtype, tuple(sorted(kw.items())))
        if key not in cache:
            shape = {**SHAPE, **kw}
            path = tmp_path_factory.mktemp("syn") / f"{arch}-{qtype.name}.gguf"
            cache[key] = write_synthetic_gguf(path, arch=arch, ggml_type=qtype, seed=7, **shape)
        return cache[key]

    return make


def runtime(path, backends, layers=None, output="cpu", n_ctx=64, n_batch=16, n_seq=1):
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    layers = tuple(layers or ["cpu"] * cfg.n_layer)
    plan = make_plan(gf, cfg, gpu_layers=0, n_ctx=n_ctx, n_batch=n_batch, kv_type="f16", n_seq=n_seq)
    plan = replace(plan, layers=layers, output_device=output, n_gpu_layers=layers.count("gpu"))
    return Runtime(gf, cfg, plan, backends)


def kl(p_logits, q_logits):
    p = np.exp(p_logits - p_logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lq = q_logits - q_logits.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    lp = np.log(p)
    return (p * (lp - lq)).sum(-1)


TOKENS = [1, 17, 200, 3, 45, 99, 250, 12, 7, 7, 300, 64, 5, 18, 222, 31, 90, 2, 150, 11]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K])
def test_cpu_backend_matches_reference(synthetic, arch, qtype):
    path = synthetic(arch, qtype)
    fast = runtime(path, {"cpu": CPUBackend()}).logits(TOKENS)
    ref = runtime(path, {"cpu": ReferenceBackend()}).logits(TOKENS)
    assert fast.shape == (len(TOKENS), SHAPE["n_vocab"])
    # the fast kernels quantize activations to 8 bits like llama.cpp; the reference does not, so
    # they agree on the distribution (within the 0.01-nat bound held against llama.cpp), not bits
    assert kl(ref, fast).max() < 1e-2
    assert (fast.argmax(-1) == ref.argmax(-1)).mean() >= 0.9
    assert np.abs(fast - ref).max() < 0.05 * np.abs(ref).max()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_equals_decode(synthetic, arch):
    path = synthetic(arch)
    rt = runtime(path, {"cpu": ReferenceBackend()}, n_batch=8)
    batched = rt.logits(TOKENS)  # batches of 8, every position
    rt.reset()
    stepwise = np.stack([rt.eval([t]) for t in TOKENS])
    # attention probabilities are rounded to f16 (as ggml does), so a one-ulp difference in a
    # float32 sum can move a probability by 2^-11: allow 1e-3 of the logit range
    np.testing.assert_allclose(stepwise, batched, rtol=1e-3, atol=1e-3 * np.abs(batched).max())
    rt.reset()
    last = rt.eval(TOKENS)  # eval: batched prefill, logits after the last token
    np.testing.assert_allclose(last, batched[-1], rtol=1e-3, atol=1e-3 * np.abs(batched).max())


def test_ffn_chunks_keep_groups_of_four_and_a_tail_of_eight():
    from edgellm.models.decoder import FFN_CHUNK, ffn_chunks

    for n in [1, 7, 8, 127, 128, 129, 135, 136, 137, 300, 512, 1000]:
        chunks = ffn_chunks(n)
        assert [i for i, _ in chunks] == list(range(0, n, FFN_CHUNK))[:len(chunks)]  # contiguous, in order
        assert sum(m for _, m in chunks) == n
        assert all(i % 4 == 0 for i, _ in chunks)
        assert chunks[-1][1] >= min(n, 8) and max(m for _, m in chunks) < FFN_CHUNK + 8
    assert ffn_chunks(135) == [(0, 135)] and ffn_chunks(136) == [(0, 128), (128, 8)]


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q4_K, T.Q6_K, T.Q8_0])
def test_chunked_ffn_is_the_one_call_ffn_bit_for_bit(synthetic, monkeypatch, qtype):
    """A prompt's FFN in chunks of 8 tokens (tail of 13) gives the logits of one call for all 37:
    K-quant tiled order (8+ tokens), repacked Q4_K (groups of four), Q4_1 / Q8_0 row products."""
    import edgellm.models.decoder as decoder

    path = synthetic("llama", qtype)
    tokens = (TOKENS * 2)[:37]
    whole = runtime(path, {"cpu": CPUBackend()}, n_batch=64).logits(tokens)
    monkeypatch.setattr(decoder, "FFN_CHUNK", 8)
    assert decoder.ffn_chunks(37) == [(0, 8), (8, 8), (16, 8), (24, 13)]
    chunked = runtime(path, {"cpu": CPUBackend()}, n_batch=64).logits(tokens)
    np.testing.assert_array_equal(chunked, whole)


class UnfusedCPU(CPUBackend):
    decode_block = None  # the decoder then runs every op of a block on its own
    decode_layers = None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K])
def test_fused_decode_block_is_the_unfused_ops_bit_for_bit(synthetic, arch, qtype):
    path = synthetic(arch, qtype)
    fused_backend = CPUBackend()
    fused, plain = runtime(path, {"cpu": fused_backend}), runtime(path, {"cpu": UnfusedCPU()})
    a = np.stack([fused.eval([t]) for t in TOKENS])
    b = np.stack([plain.eval([t]) for t in TOKENS])
    assert sum(p is not False for p in fused_backend._fused.values()) == SHAPE["n_layer"]  # it ran fused
    np.testing.assert_array_equal(a, b)


MIXED = (("Q5_0", "Q5_0", "Q8_0", "Q4_K", "Q5_0", "Q5_0", "Q6_K"),  # Gemma-3 Q4_K_M's two layer kinds
         ("Q4_1", "Q2_K", "Q3_K", "Q5_1", "Q5_K", "Q4_0", "Q4_K"),
         ("Q5_0", "Q5_0", "Q5_0", "Q4_K", "Q5_0", "Q5_0", "Q4_K"))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_decode_block_with_mixed_types_is_the_unfused_ops_bit_for_bit(tmp_path, arch):
    """Layers whose weights are of several types, legacy and K-quant together (decode_block's
    variant with both families of row kernels, what a Q4_K_M file runs), and each layer's own."""
    from edgellm.fetch import ROLES

    types = {f"blk.{i}.{r}.weight": T[t] for i in range(SHAPE["n_layer"]) for r, t in zip(ROLES, MIXED[i])}
    path = write_synthetic_gguf(tmp_path / "mixed.gguf", arch=arch, ggml_type=T.Q8_0, seed=7, tensor_types=types,
                                **SHAPE)
    fused_backend = CPUBackend()
    fused, plain = runtime(path, {"cpu": fused_backend}), runtime(path, {"cpu": UnfusedCPU()})
    assert [L.ffn_up.ggml_type for L in fused.model.blocks] == [T.Q5_0, T.Q4_0, T.Q5_0]
    a = np.stack([fused.eval([t]) for t in TOKENS])
    b = np.stack([plain.eval([t]) for t in TOKENS])
    assert sum(p is not False for p in fused_backend._fused.values()) == SHAPE["n_layer"]  # it ran fused
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_one_fused_call_for_every_layer_is_the_layers_one_by_one(tmp_path, arch):
    """A decode step runs every layer in one decode_layers call (the Python between the blocks
    gone): three sequences decoded together give the bits of the layers' fused calls one by one.
    Gemma-3 with 6 layers and a window of 8 has both cache groups (five sliding layers, one
    global) and both RoPE tables; the prompts outgrow the window. Mixed legacy and K-quant types."""
    from edgellm.fetch import ROLES

    shape = {**SHAPE, "n_layer": 6}
    types = {f"blk.{i}.{r}.weight": T[t] for i in range(6) for r, t in zip(ROLES, MIXED[i % 3])}
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch=arch, ggml_type=T.Q8_0, seed=5, tensor_types=types,
                                sliding_window=8, **shape)
    prompts = [TOKENS[:5], (TOKENS * 2)[3:30], (TOKENS * 2)[1:39]]  # the sliding layers drop their first blocks
    runs = {}
    for mode in ("one call", "layer by layer"):
        cpu = CPUBackend()
        rt = runtime(path, {"cpu": cpu}, n_ctx=64, n_batch=16, n_seq=3)
        if arch == "gemma3":
            assert len(rt.cache.groups) == 2 and len(set(rt.model.rope_params(il) for il in range(6))) == 2
        calls = []
        if mode == "layer by layer":
            rt.model.decode_all = lambda *a: False
        else:
            real = rt.model.decode_all
            rt.model.decode_all = lambda *a: calls.append((a[0].shape[0], real(*a))) or calls[-1][1]
        seqs = [rt.cache.new_sequence() for _ in prompts]
        for seq, p in zip(seqs, prompts):
            assert seq.grow(len(p))
            rt.forward([(seq, np.array(p))], rows=[len(p) - 1])
        out = []
        for step in range(6):
            for seq in seqs:
                assert seq.grow(1)
            out.append(rt.forward([(seq, np.array([TOKENS[step + i]])) for i, seq in enumerate(seqs)], rows=[0, 1, 2]))
        runs[mode] = np.stack(out)
        if mode == "one call":
            assert calls[3:] == [(3, True)] * 6  # the prompts (one call each) take the batch path
            assert any(p is not False and len(p.table) == 6 for p in cpu._stacks.values())
    np.testing.assert_array_equal(runs["one call"], runs["layer by layer"])


def test_sliding_window_keeps_only_the_window(synthetic):
    """gemma3 with a window of 8: the sliding layers' pool holds one sequence's window + a batch
    (blocks falling out of the window go back), and gives what a full-size pool gives."""
    from edgellm.kv_cache import BLOCK_SIZE, blocks_per_sequence

    path = synthetic("gemma3", sliding_window=8)
    rt = runtime(path, {"cpu": ReferenceBackend()}, n_ctx=128, n_batch=4)
    swa = [il for il, s in enumerate(rt.cfg.swa_layers) if s]
    gi = rt.cache.group_of[swa[0]]
    assert swa and rt.cache.groups[gi].window == 8
    assert rt.cache.groups[gi].pool.n_blocks == blocks_per_sequence(8, 128, 4) < 128 // BLOCK_SIZE
    assert all(rt.kv[il].k.shape[0] == rt.cache.groups[gi].pool.n_blocks * BLOCK_SIZE for il in swa)
    ring = rt.logits(TOKENS * 2)
    assert rt.seq.tables[gi][0] is None  # positions 0-15 are out of every later query's window
    rt_full = runtime(path, {"cpu": ReferenceBackend()}, n_ctx=64, n_batch=64)
    full = rt_full.logits(TOKENS * 2)
    np.testing.assert_allclose(ring, full, rtol=1e-4, atol=1e-4 * np.abs(full).max())
    # and the window matters: without it the logits differ after position 8
    rt_nowin = runtime(path, {"cpu": ReferenceBackend()}, n_ctx=64, n_batch=64)
    for kv in rt_nowin.kv:
        kv.window = 0
    nowin = rt_nowin.logits(TOKENS * 2)
    assert np.abs(nowin[10:] - full[10:]).max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "gemma3", "granite", "olmo2", "phi3", "gemma2"])
@pytest.mark.parametrize("n_gpu", [1, 3])
def test_hybrid_standin_matches_cpu(synthetic, arch, n_gpu):
    path = synthetic(arch)
    cpu_model = edgellm.load(path, n_ctx=64, n_batch=8)
    ref = cpu_model.logits(TOKENS)
    gf, cfg = cpu_model.gf, cpu_model.config
    gpu = StandInGPU()
    model = edgellm.Model(gf, cfg, gpu_layers=n_gpu, n_ctx=64, n_batch=8, threads=None, vram="1GiB",
                          kv_type="f16", backends={"cpu": CPUBackend(), "gpu": gpu})
    assert model.plan.layers == ("cpu",) * (3 - n_gpu) + ("gpu",) * n_gpu
    assert model.plan.output_device == "gpu"
    for il, dev in enumerate(model.plan.layers):  # each layer's KV cache on its layer's device
        assert model.runtime.model.layer_backends[il].device == dev
    out = model.logits(TOKENS)
    np.testing.assert_array_equal(out, ref)  # same ops, same order: bit-identical
    # the hidden state crossed to the GPU once per step (3 batches of 8), never back
    assert gpu.crossings == 3
    mem = model.memory()
    assert mem["gpu"]["weights"] == gpu.uploaded
    assert mem["gpu"]["kv_cache"] == sum(kv.nbytes for kv, d in zip(model.runtime.kv, model.plan.layers) if d == "gpu")
    assert set(model.runtime.timing.seconds) >= {"cpu", "gpu", "transfer"}


def test_context_full_is_a_clear_error(synthetic):
    model = edgellm.load(synthetic("llama"), n_ctx=16, n_batch=8)
    with pytest.raises(edgellm.errors.ContextFullError, match="n_ctx 16"):
        model.eval(list(range(1, 18)))
    with pytest.raises(edgellm.errors.ContextFullError, match="context holds 16"):
        next(model.generate(list(range(1, 18)), max_tokens=4))
    with pytest.raises(edgellm.errors.InvalidArgumentError, match="outside the vocabulary"):
        model.eval([SHAPE["n_vocab"] + 5])


def test_a_sequence_on_blocks_out_of_order_attends_only_to_its_own_keys(synthetic):
    """A sequence whose blocks are not consecutive in the pool (blocks recycled from other
    sequences) attends exactly as on consecutive blocks. Here it holds blocks 0, 3, 2 while another
    sequence holds block 1: its first and last slots (0 and 47) are 48 apart like consecutive
    blocks', so a first/last contiguity check would read block 1's keys instead of block 3's."""
    path = synthetic("llama", T.Q8_0)
    ids = np.array((TOKENS * 3)[:44], np.int64)
    want = runtime(path, {"cpu": CPUBackend()}, n_ctx=64, n_batch=64).logits(ids)
    rt = runtime(path, {"cpu": CPUBackend()}, n_ctx=64, n_batch=64)  # one sequence's pool: 4 blocks
    pool = rt.cache.groups[0].pool
    other, mine = rt.cache.new_sequence(), rt.cache.new_sequence()
    pool.free = [1]
    assert other.grow(16) and other.tables[0] == [1]
    rt.forward([(other, np.array(TOKENS[:16][::-1], np.int64))])  # other keys, positions 0..15
    pool.free = [2, 3, 0]  # allocate() pops from the end: 0, 3, 2
    assert mine.grow(len(ids)) and mine.tables[0] == [0, 3, 2]
    got = rt.forward([(mine, ids)])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("arch,qtype", [("llama", T.Q4_K), ("gemma3", T.Q4_K), ("llama", T.Q4_0),
                                        ("llama", T.Q4_1), ("qwen2", T.Q6_K), ("llama", T.Q3_K),
                                        ("smollm3", T.Q4_K), ("granite", T.Q4_K), ("olmo2", T.Q4_K),
                                        ("phi3", T.Q4_K), ("gemma2", T.Q4_K)])
def test_decode_tokens_of_several_sequences_get_the_bits_they_get_alone(synthetic, arch, qtype):
    """A step of decode tokens from 3 sequences (one fused block call for the three, each token
    on its own key list) gives each the logits of decoding it alone, bit for bit."""
    path = synthetic(arch, qtype)
    prompts = [TOKENS[:7], TOKENS[3:15], TOKENS[8:10]]
    rt = runtime(path, {"cpu": CPUBackend()}, n_ctx=64, n_batch=16)
    alone, seqs = _alone_then_prefilled(rt, prompts)
    together = rt.forward([(seq, np.array([5])) for seq in seqs], rows=[0, 1, 2])
    np.testing.assert_array_equal(together, np.stack(alone))


def _alone_then_prefilled(rt, prompts):
    """(each prompt's next-token logits decoded alone, then one sequence per prompt prefilled and
    waiting for that decode step)."""
    alone = []
    for p in prompts:
        seq = rt.cache.new_sequence()
        assert seq.grow(len(p) + 1)
        rt.forward([(seq, np.array(p))], rows=[len(p) - 1])
        alone.append(rt.forward([(seq, np.array([5]))], rows=[0])[0])
        seq.free()
    seqs = [rt.cache.new_sequence() for _ in prompts]
    for seq, p in zip(seqs, prompts):
        assert seq.grow(len(p) + 1)
        rt.forward([(seq, np.array(p))], rows=[len(p) - 1])
    return alone, seqs


@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0])
def test_twelve_decode_tokens_of_legacy_types_go_through_the_fused_block_bit_for_bit(synthetic, qtype):
    """A block of legacy types takes up to 16 decode tokens in one fused call (its row kernels beat
    the batch products there); each of 12 sequences gets the logits it gets alone."""
    path = synthetic("llama", qtype)
    prompts = [TOKENS[i:i + 2 + i % 3] for i in range(12)]
    cpu = CPUBackend()
    rt = runtime(path, {"cpu": cpu}, n_ctx=256, n_batch=16)
    alone, seqs = _alone_then_prefilled(rt, prompts)
    calls = []
    real = cpu.fused_ops

    class Spy:  # records (tokens, layers) of each fused call
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def decode_layers(*a):
            calls.append((a[0].shape[0], a[11].shape[0]))
            return real.decode_layers(*a)

    cpu._fused_ops = Spy()
    together = rt.forward([(seq, np.array([5])) for seq in seqs], rows=list(range(12)))
    assert calls == [(12, SHAPE["n_layer"])]  # one call: the 12 tokens through every layer
    np.testing.assert_array_equal(together, np.stack(alone))


def test_decode_steps_run_the_unfused_kernels_until_the_fused_one_is_ready(synthetic):
    """While the first run's worker still compiles the fused decode kernel (jit.STATE), the
    warm-up and the decode steps run the unfused kernels; the step after it is ready takes the fused
    kernel up. The logits are the same bits either way."""
    from edgellm.kernels.cpu.jit import STATE

    path = synthetic("gemma3", T.Q4_K)
    cpu = CPUBackend()
    calls = []
    real = cpu.fused_ops

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def decode_layers(*a):
            calls.append(a[0].shape[0])
            return real.decode_layers(*a)

    cpu._fused_ops = Spy()
    STATE.fused_compiling()
    try:
        rt = runtime(path, {"cpu": cpu}, n_ctx=64)
        assert calls == [] and cpu.compiler.fused_pending
        rt.eval(TOKENS[:6])
        unfused = [rt.eval([t]).copy() for t in TOKENS[6:10]]
        assert calls == []
        STATE.fused_compiled()
        fused = [rt.eval([t]).copy() for t in TOKENS[10:13]]
        assert calls == [1, 1, 1] and not cpu.compiler.fused_pending
    finally:
        STATE.fused_compiled()
    rt.reset()
    rt.eval(TOKENS[:6])
    again = [rt.eval([t]).copy() for t in TOKENS[6:13]]  # fused from the start
    assert len(calls) == 3 + 7
    np.testing.assert_array_equal(np.stack(unfused + fused), np.stack(again))


def test_decode_block_is_compiled_per_family_of_row_types():
    """type_mask: which row kernels a block's decode_block variant holds (legacy, K-quant or both)."""
    import numba

    from edgellm.kernels.cpu import fused

    legacy, k = fused.ROW_TYPES - fused.K_TYPES, fused.K_TYPES
    for types, mask, present in [({T.Q4_1}, (0, None), legacy), ({T.Q4_K, T.Q6_K}, (None, 0), k),
                                 ({T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K}, (0, 0), legacy | k)]:
        assert fused.type_mask(types) == mask
        assert fused._present(numba.typeof(mask)) == present
        assert fused.max_tokens(types) == (7 if types & k else 16)


@pytest.mark.parametrize("hparams, words", [({}, "granite.logit_scale' is missing"),
                                            ({"logit_scale": float("nan")}, "a finite number"),
                                            ({"logit_scale": 8.0, "residual_scale": float("inf")}, "residual_scale")])
def test_a_granite_file_with_a_bad_multiplier_is_one_clear_error(tmp_path, monkeypatch, hparams, words):
    from edgellm.models import granite

    monkeypatch.setattr(granite.Model, "FILE_HPARAMS", hparams)
    path = write_synthetic_gguf(tmp_path / "g.gguf", arch="granite", ggml_type=T.Q8_0, sparse=True, **SHAPE)
    with pytest.raises(edgellm.errors.EdgeLLMError, match=words):
        edgellm.load(path)


@pytest.mark.parametrize("arch, name", [("phi3", "attn_qkv"), ("olmo2", "post_ffw_norm"), ("granite", "ffn_gate"),
                                        ("smollm3", "attn_k"), ("olmo2", "attn_k_norm")])
def test_a_file_of_a_new_architecture_without_a_tensor_is_one_clear_error(tmp_path, arch, name):
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch=arch, ggml_type=T.Q8_0, sparse=True,
                                **{**SHAPE, **ARCH_SHAPE.get(arch, {})})
    data = bytearray(path.read_bytes())
    old = f"blk.1.{name}.weight".encode()
    i = data.index(old)
    data[i:i + len(old)] = old.replace(name.encode(), name[:-1].encode() + b"X")  # renamed: missing
    path.write_bytes(bytes(data))
    with pytest.raises(edgellm.errors.EdgeLLMError, match=f"blk.1.{name}.weight"):
        edgellm.load(path)


@pytest.mark.parametrize("kw", [{"kv_type": "q8_0"}, {"flash_attn": "on"}])
def test_soft_capped_attention_with_a_flash_path_is_one_clear_error(synthetic, kw):
    with pytest.raises(edgellm.errors.EdgeLLMError, match="soft-capped attention"):
        m = edgellm.load(synthetic("gemma2"), n_ctx=64, **kw)
        m.logits(TOKENS)


def test_a_gemma2_file_without_a_window_key_gets_llamacpps_4096(tmp_path, monkeypatch):
    from edgellm.models import gemma2

    monkeypatch.setattr(gemma2.Model, "FILE_SLIDING_WINDOW", False)  # the key is not written
    path = write_synthetic_gguf(tmp_path / "g.gguf", arch="gemma2", ggml_type=T.Q8_0, sparse=True, **SHAPE)
    assert "gemma2.attention.sliding_window" not in GGUFFile(path).metadata
    cfg = ModelConfig.from_gguf(GGUFFile(path))
    assert cfg.sliding_window == 4096 and cfg.swa_layers == (True, False, True)
