"""Synthetic GGUF writer: llama.cpp's names, shapes, metadata and tokenizer; valid quantized data;
sparse files that hold a full-size header and no data."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf.quants import dequantize

from edgellm.errors import InvalidArgumentError
from edgellm.gguf_file import GGUFFile
from edgellm.synthetic import (
    CHATML_TEMPLATE,
    FILE_TYPES,
    MERGES,
    bytes_to_unicode,
    quantize,
    storage_type,
    write_synthetic_gguf,
)

SMALL = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300)

LLAMA_BLOCK = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"}
EXTRA_BLOCK = {
    "llama": set(),
    "qwen2": {"attn_q.bias", "attn_k.bias", "attn_v.bias"},
    "qwen3": {"attn_q_norm", "attn_k_norm"},
    "gemma3": {"attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"},
}


def expected_names(arch: str, n_layer: int, tied: bool) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight"} | (set() if tied else {"output.weight"})
    for i in range(n_layer):
        for t in LLAMA_BLOCK | EXTRA_BLOCK[arch]:
            names.add(f"blk.{i}.{t}" if t.endswith(".bias") else f"blk.{i}.{t}.weight")
    return names


# ------------------------------------------------------------------------------------ K-quant encoders
# Relative RMS error of N(0,1) data after encode -> gguf-py decode. A wrong bit layout scrambles
# weights and gives errors near sqrt(2); these bounds sit a little above what round-to-nearest with
# min/max scales reaches (Q2_K 0.33, Q3_K 0.18, Q4_K 0.08, Q5_K 0.04, Q6_K 0.023 measured).
ENCODE_BOUND = {
    GGMLType.Q2_K: 0.40, GGMLType.Q3_K: 0.22, GGMLType.Q4_K: 0.10, GGMLType.Q5_K: 0.05, GGMLType.Q6_K: 0.03,
    GGMLType.Q4_0: 0.11, GGMLType.Q8_0: 0.008, GGMLType.BF16: 0.005, GGMLType.F16: 0.001,
    GGMLType.IQ4_NL: 0.10, GGMLType.IQ4_XS: 0.10,  # 0.078 / 0.079 measured
}


@pytest.mark.parametrize("ggml_type", list(ENCODE_BOUND), ids=lambda t: t.name)
def test_encoders_decode_back_with_gguf(ggml_type):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    x[3] *= 100.0  # rows of very different scale
    x[5] = 0.0  # an all-zero row must not produce NaN scales
    raw = quantize(x, ggml_type)
    y = np.asarray(dequantize(raw, ggml_type), dtype=np.float32).reshape(x.shape)
    assert np.all(np.isfinite(y))
    assert np.all(y[5] == 0.0)
    for row in (0, 3, 9):
        err = np.sqrt(np.mean((y[row] - x[row]) ** 2)) / np.sqrt(np.mean(x[row] ** 2))
        assert err < ENCODE_BOUND[ggml_type], (ggml_type.name, row, err)


def test_k_encoder_keeps_block_order():
    """Each 256-weight block's values come back in place: a ramp decodes to a ramp."""
    x = np.linspace(-1, 1, 1024, dtype=np.float32).reshape(1, 1024)
    for t in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q3_K, GGMLType.Q2_K, GGMLType.IQ4_XS,
              GGMLType.IQ4_NL):
        y = np.asarray(dequantize(quantize(x, t), t)).reshape(-1)
        assert np.corrcoef(x[0], y)[0, 1] > 0.98, t.name
        assert np.all(np.diff(y) >= -0.35), t.name  # monotone up to the quantization step


# ------------------------------------------------------------------------------------ files
@pytest.mark.parametrize("ggml_type", list(FILE_TYPES), ids=lambda t: t.name)
def test_llama_every_type_round_trips(tmp_path, ggml_type):
    path = write_synthetic_gguf(tmp_path / "m.gguf", arch="llama", ggml_type=ggml_type, **SMALL)
    f = GGUFFile(path)
    assert set(f.tensors) == expected_names("llama", 2, tied=True)
    for name, t in f.tensors.items():
        want = ggml_type if len(t.ne) == 2 else GGMLType.F32  # 2-D weights in the type, 1-D in F32
        assert t.qtype.ggml_type == want, name
    q = f.tensors["blk.1.ffn_gate.weight"]
    assert q.ne == (256, 512)
    w = q.as_float32()
    # N(0, 1/n_in): the std survives quantization within 15% (Q2_K loses the most)
    assert abs(w.std() * np.sqrt(256) - 1.0) < 0.15, w.std()
    norm = f.tensors["blk.0.attn_norm.weight"].as_float32()
    assert abs(norm.mean() - 1.0) < 0.05


@pytest.mark.parametrize("ggml_type", [GGMLType.IQ2_XXS, GGMLType.IQ1_M, GGMLType.TQ1_0], ids=lambda t: t.name)
def test_types_without_an_encoder_are_refused_by_name(tmp_path, ggml_type):
    """The grid and ternary types need llama.cpp's search to encode (their test files come from
    llama-quantize); asking the writer for one names the type and what it can write, and writes nothing."""
    with pytest.raises(InvalidArgumentError, match=rf"{ggml_type.name} is not supported.*Q4_K.*IQ4_XS"):
        write_synthetic_gguf(tmp_path / "m.gguf", arch="llama", ggml_type=ggml_type, **SMALL)
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
@pytest.mark.parametrize("ggml_type", [GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.F16], ids=lambda t: t.name)
def test_every_arch_has_llama_cpp_layout(tmp_path, arch, ggml_type):
    path = write_synthetic_gguf(tmp_path / f"{arch}.gguf", arch=arch, ggml_type=ggml_type, head_dim=128,
                                tied_output=False, **SMALL)
    f = GGUFFile(path)
    md = f.metadata
    assert set(f.tensors) == expected_names(arch, 2, tied=False)
    assert md["general.architecture"] == arch
    assert md[f"{arch}.block_count"] == 2
    assert md[f"{arch}.embedding_length"] == 256
    assert md[f"{arch}.attention.head_count"] == 4
    assert md[f"{arch}.attention.head_count_kv"] == 2
    assert md[f"{arch}.attention.key_length"] == 128  # head_dim != n_embd / n_head is written out
    t = f.tensors
    assert t["blk.0.attn_q.weight"].ne == (256, 4 * 128)  # ne = (n_embd, n_head*head_dim)
    assert t["blk.0.attn_k.weight"].ne == (256, 2 * 128)
    assert t["blk.0.attn_output.weight"].ne == (4 * 128, 256)
    assert t["blk.1.ffn_down.weight"].ne == (512, 256)
    assert t["output.weight"].ne == (256, 300)
    if arch == "qwen2":
        assert t["blk.0.attn_q.bias"].ne == (512,) and t["blk.0.attn_k.bias"].ne == (256,)
    if arch in ("qwen3", "gemma3"):
        assert t["blk.1.attn_q_norm.weight"].ne == (128,)
    if arch == "gemma3":
        assert md["gemma3.attention.sliding_window"] == 512
        assert md["gemma3.rope.freq_base_swa"] == 10000.0
        assert md["gemma3.rope.freq_base"] == 1000000.0
    assert md["tokenizer.ggml.pre"] == ("qwen2" if arch == "qwen2" else "default")


def test_gemma3_config_reads_llama_cpp_swa_pattern(tmp_path):
    """llama.cpp's gemma3 loader: 5 sliding layers then 1 global, sliding layers at rope base 10000."""
    from edgellm.config import ModelConfig

    path = write_synthetic_gguf(tmp_path / "g.gguf", arch="gemma3", n_layer=12, n_embd=256, n_head=4, n_head_kv=1,
                                n_ff=512, n_vocab=300, head_dim=64, sliding_window=128)
    cfg = ModelConfig.from_gguf(GGUFFile(path))
    assert cfg.swa_layers == tuple(il % 6 < 5 for il in range(12))
    assert cfg.sliding_window == 128 and cfg.rope_freq_base_swa == 10000.0 and cfg.head_dim_k == 64
    assert cfg.tied_output


def test_row_width_fallback_like_llama_cpp(tmp_path):
    # n_embd 96: rows of 96 cannot hold 256-weight super-blocks -> Q5_0 for Q4_K; ffn_down rows (n_ff 512) can
    path = write_synthetic_gguf(tmp_path / "f.gguf", n_layer=1, n_embd=96, n_head=3, n_head_kv=1, n_ff=512,
                                n_vocab=300, ggml_type=GGMLType.Q4_K)
    t = GGUFFile(path).tensors
    assert t["blk.0.attn_q.weight"].qtype.ggml_type == GGMLType.Q5_0
    assert t["blk.0.ffn_down.weight"].qtype.ggml_type == GGMLType.Q4_K
    assert storage_type(GGMLType.Q6_K, 96) == GGMLType.Q8_0
    assert storage_type(GGMLType.Q4_0, 80) == GGMLType.F16  # 80 is not a multiple of 32 either
    assert storage_type(GGMLType.IQ4_XS, 96) == GGMLType.IQ4_NL  # llama.cpp's fallback for IQ4_XS


def test_tokenizer_is_gpt2_bpe_with_chatml(tmp_path):
    import jinja2

    f = GGUFFile(write_synthetic_gguf(tmp_path / "t.gguf", **SMALL))
    md = f.metadata
    tokens = md["tokenizer.ggml.tokens"]
    types = np.asarray(md["tokenizer.ggml.token_type"])
    assert len(tokens) == 300 == len(types)
    byte_chars = bytes_to_unicode()
    assert tokens[:256] == byte_chars and len(set(byte_chars)) == 256
    assert byte_chars[ord("A")] == "A" and byte_chars[ord(" ")] == "Ġ" and byte_chars[ord("\n")] == "Ċ"
    assert md["tokenizer.ggml.model"] == "gpt2"
    assert list(md["tokenizer.ggml.merges"]) == list(MERGES)
    for merge in MERGES:  # every merge's result is a token
        assert merge.replace(" ", "") in tokens
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(special)] == 3  # CONTROL
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "<|endoftext|>"
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert np.all(types[-10:] == 5)  # padding: UNUSED
    text = jinja2.Template(md["tokenizer.chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert md["tokenizer.chat_template"] == CHATML_TEMPLATE
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_vocab_too_small_is_refused(tmp_path):
    from edgellm.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="n_vocab"):
        write_synthetic_gguf(tmp_path / "v.gguf", **{**SMALL, "n_vocab": 100})


# ------------------------------------------------------------------------------------ sparse
def test_sparse_header_equals_dense_header(tmp_path):
    """Same shape, sparse and dense: identical tensor tables, offsets and file size."""
    dense = GGUFFile(write_synthetic_gguf(tmp_path / "d.gguf", arch="qwen2", **SMALL))
    sparse = GGUFFile(write_synthetic_gguf(tmp_path / "s.gguf", arch="qwen2", sparse=True, **SMALL))
    assert dense.file_size == sparse.file_size
    table = lambda f: [(t.name, t.qtype.name, t.ne, t.offset, t.nbytes) for t in f.tensors.values()]  # noqa: E731
    assert table(dense) == table(sparse)


LLAMA2_7B = dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000,
                 tied_output=False)


def test_sparse_7b_takes_no_disk(tmp_path):
    t0 = time.perf_counter()
    path = write_synthetic_gguf(tmp_path / "7b.gguf", ggml_type=GGMLType.F16, sparse=True, **LLAMA2_7B)
    elapsed = time.perf_counter() - t0
    st = os.stat(path)
    f = GGUFFile(path)
    data = sum(t.nbytes for t in f.tensors.values())
    # Llama-2-7B's 6,738,415,616 parameters at 2 bytes, plus 2 more for each of the 65 F32 norms' weights
    assert data == 6_738_415_616 * 2 + (2 * 32 + 1) * 4096 * 2
    last = max(f.tensors.values(), key=lambda t: t.offset)
    assert last.offset + last.nbytes <= st.st_size < last.offset + last.nbytes + f.alignment
    assert st.st_size > 13e9
    assert st.st_blocks * 512 < 8 * 2**20  # allocated: the header (tokenizer) only
    assert elapsed < 2.0, elapsed
