"""GGUF reader: zero-copy views, metadata, and one specific error per kind of malformed file."""
from __future__ import annotations

import struct
import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgellm import errors
from edgellm.config import ModelConfig
from edgellm.gguf_file import GGUFFile


def write_tiny(path, *, arch="llama", drop_key=None, tensor_type=gguf.GGMLQuantizationType.F32):
    """A one-block llama-shaped file: metadata + a few F32 / Q8_0 tensors."""
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "embedding_length": 32, "block_count": 1, "feed_forward_length": 64, "attention.head_count": 4,
        "attention.head_count_kv": 2, "context_length": 128,
    }
    for k, v in keys.items():
        if k != drop_key:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float32))
    q = gguf.quants.quantize(rng.standard_normal((32, 32)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    return write_tiny(tmp_path / "tiny.gguf")


def tensor_field_offset(data: bytes, name: str) -> int:
    """Byte offset just past a tensor's name in the tensor-info table."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = data.rindex(key)
    return i + len(key)


def patched(tmp_path, src, edit) -> str:
    data = bytearray(src.read_bytes())
    edit(data)
    out = tmp_path / "bad.gguf"
    out.write_bytes(bytes(data))
    return out


def test_reads_metadata_and_tensors_as_views(tiny):
    f = GGUFFile(tiny)
    assert f.version == 3
    assert f.metadata["llama.embedding_length"] == 32
    assert f.metadata["tokenizer.ggml.tokens"][:3] == ["t0", "t1", "t2"]
    t = f.tensors["blk.0.attn_q.weight"]
    assert t.qtype.name == "Q8_0" and t.ne == (32, 32) and t.shape == (32, 32)
    assert t.data.shape == (32, 34)
    assert np.shares_memory(t.data, f._map)  # a view of the mapping, not a copy
    emb = f.tensors["token_embd.weight"].as_float32()
    expected = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    np.testing.assert_array_equal(emb, expected)
    assert t.offset % 32 == 0


def test_config_from_metadata(tiny):
    cfg = ModelConfig.from_gguf(GGUFFile(tiny))
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim_k) == ("llama", 1, 32, 4, 2, 8)
    assert cfg.n_vocab == 16 and cfg.tied_output and cfg.rope_freq_base == 10000.0


def test_not_gguf(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: d.__setitem__(slice(0, 4), b"GGML"))
    with pytest.raises(errors.NotGGUFError, match="not a GGUF file"):
        GGUFFile(bad)


def test_unsupported_version(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: d.__setitem__(slice(4, 8), struct.pack("<I", 99)))
    with pytest.raises(errors.UnsupportedVersionError, match="version 99"):
        GGUFFile(bad)


@pytest.mark.parametrize("keep", [10, 30, 200])
def test_truncated_header(tmp_path, tiny, keep):
    bad = patched(tmp_path, tiny, lambda d: d.__delitem__(slice(keep, None)))
    with pytest.raises(errors.TruncatedFileError, match="truncated"):
        GGUFFile(bad)


def test_truncated_data(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: d.__delitem__(slice(len(d) - 40, None)))
    with pytest.raises(errors.TruncatedFileError, match="output_norm.weight"):
        GGUFFile(bad)


def test_absurd_counts_do_not_allocate(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: d.__setitem__(slice(16, 24), struct.pack("<Q", 1 << 60)))
    with pytest.raises(errors.TruncatedFileError, match="metadata keys"):
        GGUFFile(bad)


def test_huge_string_length(tmp_path, tiny):
    # the first key's length field sits right after the 24-byte preamble
    bad = patched(tmp_path, tiny, lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", 1 << 50)))
    with pytest.raises(errors.TruncatedFileError):
        GGUFFile(bad)


def _set_tensor_field(d, name, n_dims, field, value):
    at = tensor_field_offset(bytes(d), name)
    pos = {"type": at + 4 + 8 * n_dims, "offset": at + 4 + 8 * n_dims + 4, "ne0": at + 4}[field]
    fmt = "<I" if field == "type" else "<Q"
    d[pos : pos + struct.calcsize(fmt)] = struct.pack(fmt, value)


def test_tensor_offset_past_eof(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: _set_tensor_field(d, "output_norm.weight", 1, "offset", 1 << 32))
    with pytest.raises(errors.TensorBoundsError, match="output_norm.weight.*past the end"):
        GGUFFile(bad)


@pytest.mark.parametrize("type_id, what", [(200, "unknown type id 200"), (39, "MXFP4")])
def test_unknown_or_unsupported_type(tmp_path, tiny, type_id, what):
    bad = patched(tmp_path, tiny, lambda d: _set_tensor_field(d, "blk.0.attn_q.weight", 2, "type", type_id))
    with pytest.raises(errors.UnsupportedTensorTypeError) as e:
        GGUFFile(bad)
    msg = str(e.value)
    assert what in msg and "blk.0.attn_q.weight" in msg and "Q4_K" in msg  # lists the supported types


@pytest.mark.parametrize("type_id, name", [(16, "IQ2_XXS"), (21, "IQ3_S")])
def test_iq_rows_not_whole_super_blocks(tmp_path, tiny, type_id, name):
    """A tensor retyped to an IQ type whose rows are not whole 256-blocks: one clear error."""
    bad = patched(tmp_path, tiny, lambda d: _set_tensor_field(d, "blk.0.attn_q.weight", 2, "type", type_id))
    with pytest.raises(errors.TensorShapeError, match=f"blk.0.attn_q.weight.*not a whole number of {name} blocks"):
        GGUFFile(bad)


def test_shape_not_whole_blocks(tmp_path, tiny):
    bad = patched(tmp_path, tiny, lambda d: _set_tensor_field(d, "blk.0.attn_q.weight", 2, "ne0", 33))
    with pytest.raises(errors.TensorShapeError, match="Q8_0 blocks"):
        GGUFFile(bad)


@pytest.mark.parametrize("type_id, ne0, what", [(20, 48, "IQ4_NL blocks (32 elements each)"),
                                                 (23, 32, "IQ4_XS blocks (256 elements each)")])
def test_iq4_rows_not_whole_blocks(tmp_path, tiny, type_id, ne0, what):
    """IQ4_NL rows must be whole 32-blocks, IQ4_XS rows whole 256-super-blocks: one clear error."""
    def edit(d):
        _set_tensor_field(d, "blk.0.attn_q.weight", 2, "type", type_id)
        _set_tensor_field(d, "blk.0.attn_q.weight", 2, "ne0", ne0)

    with pytest.raises(errors.TensorShapeError) as e:
        GGUFFile(patched(tmp_path, tiny, edit))
    assert what in str(e.value) and "blk.0.attn_q.weight" in str(e.value) and f"rows of {ne0}" in str(e.value)
    assert isinstance(e.value, errors.EdgeLLMError)


def test_missing_metadata_key(tmp_path):
    f = GGUFFile(write_tiny(tmp_path / "m.gguf", drop_key="embedding_length"))
    with pytest.raises(errors.MissingMetadataError, match="llama.embedding_length"):
        ModelConfig.from_gguf(f)


def test_unsupported_architecture(tmp_path):
    f = GGUFFile(write_tiny(tmp_path / "a.gguf", arch="mamba"))
    with pytest.raises(errors.UnsupportedArchitectureError, match="mamba.*supported: .*gemma3.*llama.*qwen2.*qwen3"):
        ModelConfig.from_gguf(f)


def test_missing_file(tmp_path):
    with pytest.raises(errors.ModelNotFoundError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


@pytest.mark.parametrize("edit, words", [
    (lambda d: d.__delitem__(slice(100, None)), "truncated"),
    (lambda d: d.__setitem__(slice(0, 4), b"\x00ELF"), "not a GGUF file"),
    (lambda d: _set_tensor_field(d, "output_norm.weight", 1, "offset", 1 << 32), "past the end"),
    (lambda d: _set_tensor_field(d, "blk.0.attn_q.weight", 2, "type", 200), "unknown type id 200"),
])
def test_cli_info_one_clear_line(tmp_path, tiny, edit, words):
    bad = patched(tmp_path, tiny, edit)
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "info", str(bad)], capture_output=True, text=True)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error:") and words in lines[0] and str(bad) in lines[0]


@pytest.mark.real
def test_real_files_open_without_reading_tensor_data(smollm2_path, gemma3_path):
    import psutil

    proc = psutil.Process()
    for path in (smollm2_path, gemma3_path):
        before = proc.memory_info().rss
        f = GGUFFile(path)
        grown = proc.memory_info().rss - before
        # the header (vocabulary) is read; the tensor data (≥ 90% of the file) is not
        assert grown < 0.5 * f.file_size, (path, grown)
        data_bytes = sum(t.nbytes for t in f.tensors.values())
        assert data_bytes > 0.9 * f.file_size


def test_string_arrays_are_held_as_bytes_and_read_as_strings(tmp_path):
    from edgellm.gguf_file import StringArray

    words = ["", "a", "Ġthe", "▁Hello", "日本語", "<0x0A>", "x" * 300, "é"]
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", words)
    w.add_array("general.tags", ["one"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    md = GGUFFile(tmp_path / "s.gguf").metadata
    arr = md["tokenizer.ggml.tokens"]
    assert isinstance(arr, StringArray) and len(arr) == len(words)
    assert arr == words and list(arr) == words and arr[1:4] == words[1:4]
    assert arr[2] == "Ġthe" and arr[-1] == "é" and arr.index("日本語") == 4 and "▁Hello" in arr
    assert arr.nbytes == len("".join(words).encode()) + 8 * (len(words) + 1)
    assert arr == StringArray(words) and arr != words[:-1]
    with pytest.raises(IndexError):
        arr[len(words)]
    assert md["general.tags"] == ["one"] and md["general.tags"][0] == "one"
    assert StringArray() == [] and len(StringArray()) == 0


def test_a_string_array_cut_short_is_a_truncated_file(tmp_path):
    words = [f"token{i}" for i in range(50)]
    w = gguf.GGUFWriter(str(tmp_path / "s.gguf"), "llama")
    w.add_array("tokenizer.ggml.tokens", words)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    data = (tmp_path / "s.gguf").read_bytes()
    cut = data.index(b"token30") + 3  # inside the 31st string
    (tmp_path / "cut.gguf").write_bytes(data[:cut])
    with pytest.raises(errors.TruncatedFileError, match="tokenizer.ggml.tokens"):
        GGUFFile(tmp_path / "cut.gguf")
