"""Hostile input: crafted GGUF files (one metadata value or tensor changed at a time, written with
gguf's writer), chat-template payloads and odd paths. Each must end in one specific, one-line
`EdgeLLMError` that names the key or tensor and the file — never a traceback, a hang, or a kernel
run with shapes the metadata does not describe."""
from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from gguf import GGUFValueType, GGUFWriter

from edgellm import errors
from edgellm.chat import ChatTemplate
from edgellm.config import ModelConfig
from edgellm.errors import printable
from edgellm.gguf_file import GGUFFile, StringArray
from edgellm.synthetic import write_synthetic_gguf

# base model: head_dim 16, 2 blocks, 300 tokens, all F32
N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_VOCAB, N_LAYER = 64, 4, 2, 128, 300, 2
HEAD_DIM = N_EMBD // N_HEAD
U64_MAX, I32_MAX = 2**64 - 1, 2**31 - 1
V = GGUFValueType
_NP_TO_GGUF = {np.dtype(np.uint8): V.UINT8, np.dtype(np.int8): V.INT8, np.dtype(np.uint16): V.UINT16,
               np.dtype(np.int16): V.INT16, np.dtype(np.uint32): V.UINT32, np.dtype(np.int32): V.INT32,
               np.dtype(np.float32): V.FLOAT32, np.dtype(np.uint64): V.UINT64, np.dtype(np.int64): V.INT64,
               np.dtype(np.float64): V.FLOAT64, np.dtype(np.bool_): V.BOOL}
_CODES = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
          V.FLOAT32: "f", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d", V.BOOL: "?"}


# --- writing crafted files -------------------------------------------------------------------
class Raw:
    """A metadata value given as its GGUF type and the exact bytes after the type."""

    def __init__(self, vtype: GGUFValueType, data: bytes):
        self.vtype, self.data = vtype, data


def scalar(vtype, value) -> Raw:
    return Raw(vtype, struct.pack("<" + _CODES[vtype], value))


def string(s: str) -> Raw:
    b = s.encode("utf-8", "surrogateescape")
    return Raw(V.STRING, struct.pack("<Q", len(b)) + b)


def array(etype, items, count=None) -> Raw:
    """An array of scalars, strings (str items) or arrays (Raw items of type ARRAY)."""
    body = b"".join(string(x).data if etype == V.STRING else x.data if isinstance(x, Raw)
                    else struct.pack("<" + _CODES[etype], x) for x in items)
    return Raw(V.ARRAY, struct.pack("<IQ", etype, len(items) if count is None else count) + body)


def _as_raw(value, vtype) -> Raw:
    if isinstance(value, StringArray):
        return array(V.STRING, list(value))
    if isinstance(value, np.ndarray):
        return array(_NP_TO_GGUF[value.dtype], value.tolist())
    if isinstance(value, list):
        return array(V.ARRAY, [_as_raw(v, V.ARRAY) for v in value])
    return string(value) if vtype == V.STRING else scalar(V(vtype), value)


class _Writer(GGUFWriter):
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
        if isinstance(val, Raw):
            return (self._pack("I", val.vtype) if add_vtype else b"") + val.data
        return super()._pack_val(val, vtype, add_vtype, sub_type)


DROP = object()


def rewrite(src, dst, meta=None, tensors=None):
    """Copy the GGUF file `src` to `dst` with metadata keys replaced (a Raw value) or removed
    (DROP), and tensors replaced (a numpy shape, rows first: random F32 of that shape) or removed."""
    meta, tensors = meta or {}, tensors or {}
    gf = GGUFFile(src)
    w = _Writer(str(dst), arch=None)
    for key, value in gf.metadata.items():
        if key not in meta:
            w.add_key_value(key, _as_raw(value, gf.metadata_types[key]), V.ARRAY)
    for key, value in meta.items():
        if value is not DROP:
            w.add_key_value(key, value, V.ARRAY)
    rng = np.random.default_rng(1)
    for name, t in gf.tensors.items():
        shape = tensors.get(name, tuple(reversed(t.ne)))
        if shape is not DROP:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) if name in tensors
                         else t.as_float32().reshape(shape))
    for name, shape in tensors.items():
        if name not in gf.tensors and shape is not DROP:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    gf.close()
    return dst


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_synthetic_gguf(tmp_path_factory.mktemp("hostile") / "base.gguf", arch="llama",
                                n_layer=N_LAYER, n_embd=N_EMBD, n_head=N_HEAD, n_head_kv=N_HEAD_KV,
                                n_ff=N_FF, n_vocab=N_VOCAB, ggml_type=0)  # F32


def test_rewrite_keeps_a_valid_file(base, tmp_path):
    """The rewriting itself changes nothing: the copy reads as the same model."""
    copy = rewrite(base, tmp_path / "copy.gguf")
    a, b = ModelConfig.from_gguf(GGUFFile(base)), ModelConfig.from_gguf(GGUFFile(copy))
    assert a == b and (b.n_layer, b.n_embd, b.head_dim_k, b.n_rot, b.n_vocab) == (2, 64, 16, 16, 300)
    np.testing.assert_array_equal(GGUFFile(copy).tensors["blk.1.ffn_up.weight"].as_float32(),
                                  GGUFFile(base).tensors["blk.1.ffn_up.weight"].as_float32())


# --- one metadata value at a time ------------------------------------------------------------
L = "llama."
NAN32 = scalar(V.FLOAT32, math.nan)
META_CASES = [
    # (key, value, error class, words the message must hold)
    (L + "block_count", scalar(V.UINT32, 0), errors.MetadataValueError, "llama.block_count"),
    (L + "block_count", scalar(V.UINT32, I32_MAX), errors.ModelShapeError, "llama.block_count"),
    (L + "block_count", scalar(V.UINT32, 1), errors.ModelShapeError, "tensors for block 1"),
    (L + "block_count", scalar(V.UINT64, U64_MAX), errors.MetadataValueError, "llama.block_count"),
    (L + "block_count", NAN32, errors.MetadataValueError, "llama.block_count"),
    (L + "block_count", array(V.UINT32, [2, 2]), errors.MetadataValueError, "llama.block_count"),
    (L + "block_count", string("2"), errors.MetadataValueError, "llama.block_count"),
    (L + "block_count", DROP, errors.MissingMetadataError, "llama.block_count"),
    (L + "embedding_length", scalar(V.UINT32, 0), errors.MetadataValueError, "llama.embedding_length"),
    (L + "embedding_length", scalar(V.UINT32, 96), errors.ModelShapeError, "token_embd.weight"),
    (L + "embedding_length", scalar(V.INT32, -64), errors.MetadataValueError, "llama.embedding_length"),
    (L + "attention.head_count", scalar(V.UINT32, 0), errors.MetadataValueError, "attention.head_count"),
    (L + "attention.head_count", scalar(V.UINT32, 3), errors.MetadataValueError, "head_count_kv"),
    (L + "attention.head_count", array(V.UINT32, []), errors.MetadataValueError, "attention.head_count"),
    (L + "attention.head_count", array(V.UINT32, [4, 8]), errors.MetadataValueError, "attention.head_count"),
    (L + "attention.head_count", scalar(V.UINT64, U64_MAX), errors.MetadataValueError, "attention.head_count"),
    (L + "attention.head_count_kv", scalar(V.UINT32, 0), errors.MetadataValueError, "head_count_kv"),
    (L + "attention.head_count_kv", scalar(V.UINT32, 8), errors.MetadataValueError, "head_count_kv"),
    (L + "attention.head_count_kv", scalar(V.UINT32, 4), errors.ModelShapeError, "blk.0.attn_k.weight"),
    (L + "attention.key_length", scalar(V.UINT32, 0), errors.MetadataValueError, "attention.key_length"),
    (L + "attention.key_length", scalar(V.UINT32, 32), errors.ModelShapeError, "blk.0.attn_q.weight"),
    (L + "attention.value_length", scalar(V.UINT32, 8), errors.ModelShapeError, "blk.0.attn_v.weight"),
    # rope.dimension_count past the head size wrote past the rope kernel's buffer
    (L + "rope.dimension_count", scalar(V.UINT32, 18), errors.MetadataValueError, "rope.dimension_count"),
    (L + "rope.dimension_count", scalar(V.UINT32, 72), errors.MetadataValueError, "rope.dimension_count"),
    (L + "rope.dimension_count", scalar(V.UINT32, 15), errors.MetadataValueError, "rope.dimension_count"),
    (L + "rope.dimension_count", scalar(V.UINT32, 0), errors.MetadataValueError, "rope.dimension_count"),
    (L + "feed_forward_length", scalar(V.UINT32, 127), errors.ModelShapeError, "blk.0.ffn_gate.weight"),
    (L + "feed_forward_length", scalar(V.UINT32, 0), errors.MetadataValueError, "feed_forward_length"),
    (L + "feed_forward_length", array(V.UINT32, [128, 64]), errors.MetadataValueError, "feed_forward_length"),
    (L + "feed_forward_length", array(V.ARRAY, [array(V.UINT32, [128])]), errors.MetadataValueError,
     "feed_forward_length"),
    (L + "vocab_size", scalar(V.UINT32, 299), errors.MetadataValueError, "llama.vocab_size"),
    (L + "context_length", scalar(V.UINT32, 0), errors.MetadataValueError, "llama.context_length"),
    (L + "context_length", NAN32, errors.MetadataValueError, "llama.context_length"),
    (L + "attention.layer_norm_rms_epsilon", scalar(V.FLOAT32, 0.0), errors.MetadataValueError, "rms_epsilon"),
    (L + "attention.layer_norm_rms_epsilon", scalar(V.FLOAT32, -1e-5), errors.MetadataValueError, "rms_epsilon"),
    (L + "attention.layer_norm_rms_epsilon", NAN32, errors.MetadataValueError, "rms_epsilon"),
    (L + "attention.layer_norm_rms_epsilon", scalar(V.FLOAT32, math.inf), errors.MetadataValueError, "rms_epsilon"),
    (L + "attention.layer_norm_rms_epsilon", array(V.FLOAT32, [1e-5]), errors.MetadataValueError, "rms_epsilon"),
    (L + "rope.freq_base", scalar(V.FLOAT32, 0.0), errors.MetadataValueError, "rope.freq_base"),
    (L + "rope.freq_base", scalar(V.FLOAT32, -10000.0), errors.MetadataValueError, "rope.freq_base"),
    (L + "rope.freq_base", NAN32, errors.MetadataValueError, "rope.freq_base"),
    # a tiny base overflowed RoPE's float32 angles (a NumPy RuntimeWarning, then NaN logits)
    (L + "rope.freq_base", scalar(V.FLOAT32, 1e-38), errors.MetadataValueError, "rope.freq_base"),
    (L + "rope.scaling.factor", NAN32, errors.MetadataValueError, "rope.scaling.factor"),
    (L + "rope.scaling.type", scalar(V.UINT32, 1), errors.MetadataValueError, "rope.scaling.type"),
    ("general.name", scalar(V.UINT32, 7), errors.MetadataValueError, "general.name"),
    ("general.architecture", scalar(V.UINT32, 7), errors.MetadataValueError, "general.architecture"),
    ("tokenizer.ggml.tokens", array(V.UINT32, list(range(N_VOCAB))), errors.TokenizerError, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens", array(V.STRING, []), errors.TokenizerError, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens", array(V.ARRAY, [array(V.STRING, ["a"])]), errors.TokenizerError,
     "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens", array(V.STRING, [f"t{i}" for i in range(N_VOCAB - 1)]), errors.MetadataValueError,
     "vocab_size"),
    ("tokenizer.ggml.merges", array(V.INT32, [1, 2]), errors.TokenizerError, "tokenizer.ggml.merges"),
    ("tokenizer.ggml.token_type", array(V.INT32, [1] * (N_VOCAB - 1) + [99]), errors.TokenizerError,
     "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.token_type", array(V.INT32, [-1] + [1] * (N_VOCAB - 1)), errors.TokenizerError,
     "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.token_type", array(V.FLOAT32, [1.0] * N_VOCAB), errors.TokenizerError,
     "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.scores", array(V.STRING, ["x"] * N_VOCAB), errors.TokenizerError, "tokenizer.ggml.scores"),
    ("tokenizer.ggml.bos_token_id", scalar(V.UINT32, N_VOCAB), errors.TokenizerError, "bos_token_id"),
    ("tokenizer.ggml.eos_token_id", scalar(V.UINT32, 2**32 - 1), errors.TokenizerError, "eos_token_id"),
    ("tokenizer.ggml.eos_token_id", NAN32, errors.TokenizerError, "eos_token_id"),
    ("tokenizer.ggml.bos_token_id", array(V.UINT32, []), errors.TokenizerError, "bos_token_id"),
    ("tokenizer.ggml.model", scalar(V.UINT32, 2), errors.MetadataValueError, "tokenizer.ggml.model"),
    ("tokenizer.ggml.add_bos_token", array(V.BOOL, [True]), errors.MetadataValueError, "add_bos_token"),
    ("tokenizer.chat_template", scalar(V.UINT32, 0), errors.MetadataValueError, "tokenizer.chat_template"),
]


def _id(case):
    key, value, cls, _ = case
    what = "drop" if value is DROP else f"{value.vtype.name.lower()}{len(value.data)}"
    return f"{key.split('.', 1)[1]}-{what}-{cls.__name__}"


@pytest.mark.parametrize("key, value, cls, words", META_CASES, ids=[_id(c) for c in META_CASES])
def test_bad_metadata_value_is_one_clear_error(base, tmp_path, key, value, cls, words):
    bad = rewrite(base, tmp_path / "bad.gguf", meta={key: value})
    with pytest.raises(errors.EdgeLLMError) as info:
        ModelConfig.from_gguf(GGUFFile(bad))
    assert type(info.value) is cls, str(info.value)
    msg = str(info.value)
    assert words in msg and str(bad) in msg and "\n" not in msg, msg


@pytest.mark.parametrize("factor, ok", [(1e-40, False), (1e-33, False), (1e-28, True), (0.25, True), (8.0, True)])
def test_a_linear_rope_factor_that_overflows_the_angles_is_one_clear_error(base, tmp_path, factor, ok):
    """Linear RoPE scaling divides the angles by the factor; a subnormal factor made them inf."""
    bad = rewrite(base, tmp_path / "bad.gguf", meta={L + "rope.scaling.type": string("linear"),
                                                   L + "rope.scaling.factor": scalar(V.FLOAT32, factor)})
    if ok:
        assert ModelConfig.from_gguf(GGUFFile(bad)).rope_freq_scale == pytest.approx(1 / np.float32(factor))
        return
    with pytest.raises(errors.MetadataValueError) as info:
        ModelConfig.from_gguf(GGUFFile(bad))
    msg = str(info.value)
    assert "rope.scaling.factor" in msg and "finite" in msg and "\n" not in msg, msg


TENSOR_CASES = [
    # (tensor -> new numpy shape or DROP, error class, words)
    ({"token_embd.weight": (N_VOCAB - 1, N_EMBD)}, errors.ModelShapeError, "token_embd.weight"),
    ({"output.weight": (N_VOCAB + 1, N_EMBD)}, errors.ModelShapeError, "output.weight"),
    ({"blk.0.ffn_up.weight": (N_FF * N_EMBD,)}, errors.ModelShapeError, "blk.0.ffn_up.weight"),
    ({"blk.1.attn_norm.weight": (2, N_EMBD)}, errors.ModelShapeError, "blk.1.attn_norm.weight"),
    ({"blk.0.attn_q.weight": (N_EMBD, N_EMBD, 1)}, errors.ModelShapeError, "blk.0.attn_q.weight"),
    ({"blk.0.attn_q.bias": (N_EMBD + 1,)}, errors.ModelShapeError, "blk.0.attn_q.bias"),
    ({"blk.0.attn_k_norm.weight": (HEAD_DIM * 2,)}, errors.ModelShapeError, "blk.0.attn_k_norm.weight"),
    ({"output_norm.weight": DROP}, errors.ModelShapeError, "output_norm.weight"),
    ({f"blk.1.{n}.weight": DROP for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                          "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")},
     errors.ModelShapeError, "block_count"),
]


@pytest.mark.parametrize("edit, cls, words", TENSOR_CASES, ids=[c[2] for c in TENSOR_CASES])
def test_tensor_disagreeing_with_metadata_is_one_clear_error(base, tmp_path, edit, cls, words):
    bad = rewrite(base, tmp_path / "bad.gguf", tensors=edit)
    with pytest.raises(cls) as info:
        ModelConfig.from_gguf(GGUFFile(bad))
    msg = str(info.value)
    assert words in msg and str(bad) in msg and "\n" not in msg, msg


def test_a_file_with_no_tensors(base, tmp_path):
    gf = GGUFFile(base)
    bad = rewrite(base, tmp_path / "empty.gguf", tensors=dict.fromkeys(gf.tensors, DROP))
    with pytest.raises(errors.ModelShapeError, match="no tensors for block 0"):
        ModelConfig.from_gguf(GGUFFile(bad))


def test_per_layer_arrays_of_one_value_are_read(base, tmp_path):
    """Files that store head counts / n_ff per layer (all equal) are fine."""
    ok = rewrite(base, tmp_path / "ok.gguf", meta={L + "feed_forward_length": array(V.UINT32, [N_FF] * N_LAYER),
                                                  L + "attention.head_count_kv": array(V.INT32, [2, 2])})
    cfg = ModelConfig.from_gguf(GGUFFile(ok))
    assert (cfg.n_ff, cfg.n_head_kv) == (N_FF, 2)


def test_nested_arrays_too_deep(base, tmp_path):
    deep = array(V.UINT8, [1])
    for _ in range(100):  # Python's recursion limit would be hit near 1000
        deep = array(V.ARRAY, [deep])
    bad = rewrite(base, tmp_path / "deep.gguf", meta={"general.junk": deep})
    with pytest.raises(errors.GGUFError, match="nested more than"):
        GGUFFile(bad)


def test_array_count_of_u64_max(base, tmp_path):
    bad = rewrite(base, tmp_path / "count.gguf", meta={"general.junk": array(V.UINT32, [1], count=U64_MAX)})
    with pytest.raises(errors.TruncatedFileError, match="general.junk"):
        GGUFFile(bad)


# --- file text is never printed raw ------------------------------------------------------------
HOSTILE_NAME = "evil\x1b]0;pwned\x07\x1b[2J\x1b[31mred\nsecond line\u202e" + "x" * 500


def test_name_with_escape_sequences_is_escaped_and_cut(base, tmp_path):
    f = rewrite(base, tmp_path / "name.gguf", meta={"general.name": string(HOSTILE_NAME)})
    cfg = ModelConfig.from_gguf(GGUFFile(f))
    assert cfg.name.startswith("evil\\x1b]0;pwned\\x07\\x1b[2J") and "\\u202e" in cfg.name
    assert cfg.name.isprintable() and len(cfg.name) < 150 and "more characters" in cfg.name


def test_error_messages_are_one_printable_line():
    e = errors.GGUFError("key 'a\x1b[31m\nb' is bad" + "y" * 5000)
    s = str(e)
    assert s.isprintable() and s.startswith("key 'a\\x1b[31m\\x0ab'") and len(s) < 1100
    assert printable("ok text") == "ok text"


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "edgellm.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "NO_COLOR": "1"})


def test_cli_info_escapes_file_text(base, tmp_path):
    f = rewrite(base, tmp_path / "name.gguf", meta={"general.name": string(HOSTILE_NAME),
                                                   "tokenizer.ggml.pre": string("default\x1b[2J")})
    gf = GGUFFile(f)
    assert gf.metadata["tokenizer.ggml.pre"] == "default\x1b[2J"
    r = _cli("info", f)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout and "\u202e" not in r.stdout
    assert "evil\\x1b]0;pwned" in r.stdout and "second line" in r.stdout.splitlines()[1]
    r = _cli("info", f, "--json")
    assert r.returncode == 0 and "\x1b" not in r.stdout and "\\u001b" in r.stdout


@pytest.mark.parametrize("command", ["info", "run"])
def test_cli_hostile_file_one_line_exit_1(base, tmp_path, command):
    bad = rewrite(base, tmp_path / "evil\x1b[31m.gguf", meta={L + "rope.dimension_count": scalar(V.UINT32, 72),
                                                            "general.name": string(HOSTILE_NAME)})
    args = ("info", bad) if command == "info" else ("run", bad, "-p", "hi", "-n", "1")
    r = _cli(*args)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "\x1b" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "rope.dimension_count" in lines[0] and "72" in lines[0], r.stderr


def _invalid_utf8(src, dst, needle: bytes, at: int = 0):
    """A copy of `src` with one byte of the first `needle` set to 0xff (not UTF-8 in any string)."""
    data = bytearray(src.read_bytes())
    data[data.index(needle) + at] = 0xFF
    dst.write_bytes(bytes(data))
    return dst


@pytest.mark.parametrize("needle, at", [(b"general.name", 8), (b"synthetic-llama", 0), (b"blk.1.ffn_up.weight", 6)],
                         ids=["key", "name", "tensor"])
def test_strings_that_are_not_utf8_are_carried_safely(base, tmp_path, needle, at):
    """A key, the model's name or a tensor name that is not valid UTF-8: the model loads, generates
    and quantizes (the bytes written back as they were, as llama-quantize does), and the quality
    store's key is computed; a tensor the model needs under that name is missing, one clear error."""
    import edgellm
    from edgellm.quality.store import model_key

    f = _invalid_utf8(base, tmp_path / "bad.gguf", needle, at)
    gf = GGUFFile(f)
    assert len(model_key(gf)) == 16
    if needle.startswith(b"blk"):
        with pytest.raises(errors.MissingMetadataError, match="blk.1.ffn_up.weight. is missing"):
            edgellm.load(f)
    else:
        m = edgellm.load(f, n_ctx=64)
        assert len([c for c in m.generate("hi", max_tokens=3, temperature=0, ignore_eos=True)]) == 3
    out = tmp_path / "q.gguf"
    r = _cli("quantize", f, out, "Q8_0", "--allow-requantize")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    bad = needle[:at] + b"\xff" + needle[at + 1:]
    assert bad in out.read_bytes()


def test_api_load_refuses_hostile_file(base, tmp_path):
    import edgellm

    bad = rewrite(base, tmp_path / "bad.gguf", tensors={"blk.0.ffn_up.weight": (N_FF * N_EMBD,)})
    with pytest.raises(errors.ModelShapeError, match="blk.0.ffn_up.weight"):
        edgellm.load(bad)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this system")
def test_named_pipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    r = _cli("info", fifo, timeout=60)  # the old reader blocked forever in open()
    assert r.returncode == 1 and "not a regular file" in r.stderr and "Traceback" not in r.stderr


# --- chat templates are bounded ----------------------------------------------------------------
TEMPLATE_PAYLOADS = {
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested_output": "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
    "lipsum": "{{ lipsum(10**6) }}",
    "repeat": "{{ 'a' * 10**8 }}",
    "repeat_const": "{{ 'a' * 100000000 }}",
    "repeat_list": "{{ (['a'] * 10**8)|length }}",
    "printf_width": "{{ '%0999999999d' % 1 }}",
    "printf_star": "{{ '%*d' % (999999999, 1) }}",
    "power": "{{ 2 ** (10 ** 8) }}",
    "squaring": "{% set ns = namespace(x=10) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}"
                "{% endfor %}{{ ns.x }}",
    "center": "{{ 'x'|center(999999999) }}",
    "ljust": "{{ 'x'.ljust(999999999) }}",
    "str_format": "{{ '{:>999999999}'.format(1) }}",
    "str_format_nested": "{{ '{:{}}'.format(1, 999999999) }}",
    "format_filter": "{{ '%999999999s'|format(1) }}",
    "indent": "{{ ('a\n' * 1000)|indent(999999) }}",
    "replace": "{% set s = 'a' * 1000 %}{{ s|replace('a', s)|replace('a', s) }}",
    "concat_doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "plus_doubling": "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}{{ ns.s|length }}",
    "set_block": "{% set s = 'a' * 1000000 %}{% set x %}{% for i in range(1000) %}{{ s }}{% endfor %}"
                 "{% endset %}{{ x|length }}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "join": "{% set s = 'a' * 1000000 %}{{ ([1] * 100000)|join(s) }}",
    "str_join": "{{ ('a' * 1000000).join(['x'] * 1000) }}",
    "batch": "{{ [1]|batch(999999999, 'x')|list|length }}",
    "slice": "{{ [1]|slice(999999999)|list|length }}",
    "expandtabs": "{{ ('\t' * 1000).expandtabs(999999) }}",
    "tojson_indent": "{{ messages|tojson(indent=999999999) }}",
    "syntax": "{% for %}",
    "internals": "{{ messages.__class__.__mro__ }}",
}


@pytest.mark.parametrize("name", sorted(TEMPLATE_PAYLOADS))
def test_template_payload_fails_fast_and_small(name):
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(errors.TemplateError) as info:
            ChatTemplate(TEMPLATE_PAYLOADS[name]).render([{"role": "user", "content": "hi"}], bos_token="",
                                                         eos_token="")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 2.0
    assert peak < 200 * 2**20, peak
    assert "\n" not in str(info.value)


def test_limits_leave_real_templates_alone():
    """A template that loops, formats and concatenates within the limits renders as jinja would."""
    src = ("{% for m in messages %}{{ '%-6s|' % m['role'] }}{{ m['content'] ~ '!' }}"
           "{{ '{:>4}'.format(loop.index) }}{{ (m['content'] * 3)|center(20) }}\n{% endfor %}")
    messages = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "d" * 300_000}]
    out = ChatTemplate(src).render(messages, bos_token="", eos_token="")
    expected = "".join(f"{'%-6s|' % m['role']}{m['content']}!{i:>4}{(m['content'] * 3).center(20)}\n"
                       for i, m in enumerate(messages, 1))
    assert out == expected  # 900k characters of output: within 4 x the messages' own size
