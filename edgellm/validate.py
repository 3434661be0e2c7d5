"""Checks of a GGUF file's metadata and tensor table before anything is sized or run by them.

A GGUF file is untrusted input. `ModelConfig.from_gguf` reads every hyperparameter through
`Metadata` (typed getters: an integer in range, a finite positive float, a string, a uniform
per-layer array), then `check_tensors` compares every tensor the model uses with the shape the
config implies (as llama.cpp's loader does tensor by tensor) and `check_tokenizer` checks the
vocabulary's arrays and token ids. Each failure is one `EdgeLLMError` naming the key or tensor and
the file; no kernel ever sees a shape the config does not describe.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgellm.errors import (
    MetadataValueError,
    MissingMetadataError,
    ModelShapeError,
    TokenizerError,
    printable,
)

MAX_COUNT = 2**31 - 1  # hyperparameters are int32 in llama.cpp; anything larger is corrupt
# llama.cpp's token types: UNDEFINED 0, NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
N_TOKEN_TYPES = 7
# token ids that steer generation: one past the vocabulary is an error, not a silent default
GENERATION_IDS = ("bos", "eos", "eot", "eom")


def describe(value: Any) -> str:
    """A short, printable description of a metadata value for an error message."""
    if isinstance(value, bool):
        return f"the boolean {value}"
    if isinstance(value, (int, float, np.integer, np.floating)):
        return f"{value!r}"
    if isinstance(value, str):
        return f"the string {printable(repr(value))}"
    if isinstance(value, np.ndarray):
        return f"an array of {len(value)} {value.dtype} values"
    if isinstance(value, list):
        return f"an array of {len(value)} arrays"
    try:
        return f"an array of {len(value)} strings"
    except TypeError:
        return f"a {type(value).__name__}"


class Metadata:
    """Typed, range-checked reads of `<arch>.<key>` (or a full key) from one file's metadata."""

    def __init__(self, md: Mapping[str, Any], path: Any, arch: str = "") -> None:
        self.md, self.path, self.arch = md, path, arch

    def full(self, key: str) -> str:
        return f"{self.arch}.{key}" if self.arch and not key.startswith(("general.", "tokenizer.")) else key

    def raw(self, key: str, default: Any = ...) -> Any:
        full = self.full(key)
        if full in self.md:
            return self.md[full]
        if default is ...:
            raise MissingMetadataError(f"{self.path}: required metadata key '{full}' is missing")
        return default

    def bad(self, key: str, value: Any, expected: str) -> MetadataValueError:
        full = self.full(key)
        what = "is" if full in self.md else "is not set and its default is"
        return MetadataValueError(f"{self.path}: metadata key '{printable(full)}' {what} "
                                  f"{describe(value)}; expected {expected} (corrupt or hostile file)")

    def integer(self, key: str, default: Any = ..., lo: int = 1, hi: int = MAX_COUNT) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise self.bad(key, v, f"an integer in {lo}..{hi}")
        if not lo <= v <= hi:
            raise self.bad(key, v, f"an integer in {lo}..{hi}")
        return int(v)

    def per_layer(self, key: str, n_layer: int, default: Any = ..., lo: int = 1) -> int:
        """An integer that some files store per layer (an array); edgellm needs one value."""
        v = self.raw(key, default)
        if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu":
            if len(v) != n_layer or len(v) == 0 or (v != v[0]).any():
                raise self.bad(key, v, f"one integer, or {n_layer} equal ones (per-layer values that "
                                       "differ are not supported)")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= MAX_COUNT:
            raise self.bad(key, v, f"an integer in {lo}..{MAX_COUNT}")
        return int(v)

    def number(self, key: str, default: Any = ..., lo: float = 0.0, hi: float = math.inf) -> float:
        """A finite float in (lo, hi]."""
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise self.bad(key, v, f"a number in ({lo:g}, {hi:g}]")
        f = float(v)
        if not (math.isfinite(f) and lo < f <= hi):
            raise self.bad(key, v, f"a finite number in ({lo:g}, {hi:g}]")
        return f

    def string(self, key: str, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is not default and not isinstance(v, str):
            raise self.bad(key, v, "a string")
        return v

    def boolean(self, key: str, default: Any = ...) -> Any:
        v = self.raw(key, default)
        if v is not default and not isinstance(v, (bool, np.bool_)):
            raise self.bad(key, v, "a boolean")
        return v if v is default else bool(v)


# ---------------------------------------------------------------------------------------------
def expected_shapes(cfg, model=None) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """(required, optional) tensor name -> ne (GGUF order: elements per row first). `model`: the
    architecture's Decoder class (found from cfg.arch when None), which names the per-block tensors
    it reads (BLOCK_REQUIRED, BLOCK_OPTIONAL, BLOCK_BIASES) and may change their shapes."""
    if model is None:
        from edgellm.models import architecture

        model = architecture(cfg.arch).Model
    e, vocab = cfg.n_embd, cfg.n_vocab
    q, kv_k, kv_v, o = (cfg.n_head * cfg.head_dim_k, cfg.n_head_kv * cfg.head_dim_k,
                        cfg.n_head_kv * cfg.head_dim_v, cfg.n_head * cfg.head_dim_v)
    block = {"attn_norm": (e,), "attn_q": (e, q), "attn_k": (e, kv_k), "attn_v": (e, kv_v),
             "attn_output": (o, e), "ffn_norm": (e,), "ffn_gate": (e, cfg.n_ff), "ffn_up": (e, cfg.n_ff),
             "ffn_down": (cfg.n_ff, e), "attn_q_norm": (cfg.head_dim_k,), "attn_k_norm": (cfg.head_dim_k,),
             "post_attention_norm": (e,), "post_ffw_norm": (e,), **model.block_shapes(cfg)}
    bias = {"attn_q": (q,), "attn_k": (kv_k,), "attn_v": (kv_v,)}
    required = {"token_embd.weight": (e, vocab), "output_norm.weight": (e,)}
    # RoPE frequency factors: llama 3's rope_freqs, LongRoPE's (phi3) long and short ones
    optional = {"output.weight": (e, vocab), **dict.fromkeys(
        ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"), (cfg.n_rot // 2,))}
    for il in range(cfg.n_layer):
        required.update({f"blk.{il}.{n}.weight": block[n] for n in model.BLOCK_REQUIRED})
        optional.update({f"blk.{il}.{n}.weight": block[n] for n in model.BLOCK_OPTIONAL})
        optional.update({f"blk.{il}.{n}.bias": bias[n] for n in model.BLOCK_BIASES})
    return required, optional


_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_tensors(gf, cfg, model=None) -> None:
    """Every tensor the model reads has the shape (and rank) the config implies; token_embd and
    output_norm exist and the blocks with tensors are exactly blocks 0..n_layer-1. A block tensor missing
    altogether is reported when the model loads it (`GGUFFile.tensor`), before any kernel runs."""
    tensors = gf.tensors
    blocks = {int(m.group(1)) for name in tensors if (m := _BLOCK.match(name))}
    missing = next((il for il in range(cfg.n_layer) if il not in blocks), None)
    if missing is not None:
        raise ModelShapeError(
            f"{gf.path}: metadata key '{cfg.arch}.block_count' is {cfg.n_layer} but the file has no "
            f"tensors for block {missing} ({len(blocks)} blocks in all; corrupt or hostile file)")
    if blocks and max(blocks) >= cfg.n_layer:  # llama.cpp refuses unused tensors too
        raise ModelShapeError(
            f"{gf.path}: metadata key '{cfg.arch}.block_count' is {cfg.n_layer} but the file has "
            f"tensors for block {max(blocks)}; the file is corrupt or hostile")
    required, optional = expected_shapes(cfg, model)
    for name in ("token_embd.weight", "output_norm.weight"):
        if name not in tensors:
            raise ModelShapeError(f"{gf.path}: required tensor '{name}' is missing ({len(tensors)} "
                                  "tensors in the file)")
    for table in (required, optional):
        for name, ne in table.items():
            t = tensors.get(name)
            if t is not None and tuple(t.ne) != ne:
                raise ModelShapeError(
                    f"{gf.path}: tensor '{name}' has shape {list(t.ne)}, but the metadata implies "
                    f"{list(ne)} ({_why(name, cfg)}); the file is corrupt or hostile")


def _why(name: str, cfg) -> str:
    """The hyperparameters a tensor's expected shape comes from, for the error message."""
    a = cfg.arch
    if name.startswith(("token_embd", "output.")):
        return f"{a}.embedding_length = {cfg.n_embd}, {cfg.n_vocab} tokens in the vocabulary"
    if "ffn_gate" in name or "ffn_up" in name or "ffn_down" in name:
        return f"{a}.embedding_length = {cfg.n_embd}, {a}.feed_forward_length = {cfg.n_ff}"
    if "attn_q" in name or "attn_k" in name or "attn_v" in name or "attn_output" in name:
        return (f"{a}.embedding_length = {cfg.n_embd}, attention.head_count = {cfg.n_head}, "
                f"head_count_kv = {cfg.n_head_kv}, key_length = {cfg.head_dim_k}, "
                f"value_length = {cfg.head_dim_v}")
    return f"{a}.embedding_length = {cfg.n_embd}; a norm is one row"


# ---------------------------------------------------------------------------------------------
def check_tokenizer(md: Mapping[str, Any], where: Any = "") -> int:
    """Types and ranges of the tokenizer keys; returns the number of tokens (0 when none)."""
    from edgellm.gguf_file import StringArray

    pre = f"{where}: " if where else ""
    m = Metadata(md, where or "the model file")

    def fail(key: str, what: str) -> TokenizerError:
        return TokenizerError(f"{pre}metadata key '{key}' {what} (corrupt or hostile file)")

    tokens = md.get("tokenizer.ggml.tokens")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        v = md.get(key)
        if v is not None and not (isinstance(v, StringArray) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v))):
            raise fail(key, f"is {describe(v)}; expected an array of strings")
    n = len(tokens) if tokens is not None else 0
    if tokens is not None and n == 0:
        raise fail("tokenizer.ggml.tokens", "is an empty array; expected the vocabulary")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        m.string(key, None)
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                "tokenizer.ggml.add_space_prefix"):
        m.boolean(key, None)
    scores = md.get("tokenizer.ggml.scores")
    if scores is not None and not (isinstance(scores, np.ndarray) and scores.dtype.kind == "f"
                                   and len(scores) >= n):
        raise fail("tokenizer.ggml.scores", f"is {describe(scores)}; expected {n} floats")
    types = md.get("tokenizer.ggml.token_type")
    if types is not None:
        if not (isinstance(types, np.ndarray) and types.dtype.kind in "iu" and len(types) >= n):
            raise fail("tokenizer.ggml.token_type", f"is {describe(types)}; expected {n} integers")
        bad = np.flatnonzero((types[:n] < 0) | (types[:n] >= N_TOKEN_TYPES))
        if len(bad):
            raise fail("tokenizer.ggml.token_type",
                       f"gives token {bad[0]} the type {types[bad[0]]}; types are 0..{N_TOKEN_TYPES - 1}")
    for key in [k for k in md if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")]:
        v = md[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise fail(printable(key), f"is {describe(v)}; expected a token id")
        role = key[len("tokenizer.ggml."):-len("_token_id")]
        if role in GENERATION_IDS and n and not 0 <= v < n:
            raise fail(key, f"is {v}, past the vocabulary of {n} tokens")
    return n


# --- the CPU backend's second line of defence (against our own bugs as much as files) ------
def check_matrix_bytes(w) -> None:
    """A QMatrix (edgellm.backend) must hold exactly n_rows rows of n_cols weights of its type: the
    kernels take the row count and row length from the array, so other bytes would be read as
    another shape."""
    from edgellm.quants import quant_type

    qtype = quant_type(w.ggml_type)
    shape = getattr(w.data, "shape", None)
    if w.n_cols <= 0 or w.n_cols % qtype.block_size or shape != (w.n_rows, qtype.row_bytes(w.n_cols)):
        raise ModelShapeError(
            f"tensor '{printable(w.name)}': {w.n_rows} rows of {w.n_cols} {qtype.name} weights (rows a "
            f"multiple of {qtype.block_size}) take {w.n_rows} x {qtype.row_bytes(max(w.n_cols, 0))} bytes; "
            f"its data is {shape}")


def check_fused_block(L, x, s, kc, vc) -> None:
    """The fused one-token block (kernels/cpu/fused.py) reads each weight's rows at the width of
    the activation it multiplies and writes as many values as the weight has rows: every weight,
    norm and bias of block L must fit the hidden states x (n, n_embd), the scratch s (q, k, v, a,
    gate, ... of at least n rows) and the caches kc / vc (slots, n_kv, head_dim), or the kernel
    would read and write past its buffers. CPUBackend calls this when a block meets a new scratch,
    cache or batch shape, not per token."""
    n_embd, n_q, n_k, n_v, n_att, n_ff = (x.shape[1], s.q.shape[1], s.k.shape[1], s.v.shape[1],
                                          s.a.shape[1], s.gate.shape[1])
    n_kv, hd_k, hd_v = kc.shape[1], kc.shape[2], vc.shape[2]
    problems = []
    for name, rows, cols in (("attn_q", n_q, n_embd), ("attn_k", n_k, n_embd), ("attn_v", n_v, n_embd),
                             ("attn_output", n_embd, n_att), ("ffn_gate", n_ff, n_embd),
                             ("ffn_up", n_ff, n_embd), ("ffn_down", n_embd, n_ff)):
        w = getattr(L, name)
        if (w.n_rows, w.n_cols) != (rows, cols):
            problems.append(f"{printable(w.name or name)} is {w.n_rows} x {w.n_cols}, the block needs {rows} x {cols}")
    for name, size, optional in (("attn_norm", n_embd, False), ("ffn_norm", n_embd, False),
                                 ("post_attention_norm", n_embd, True), ("post_ffw_norm", n_embd, True),
                                 ("attn_q_norm", hd_k, True), ("attn_k_norm", hd_k, True),
                                 ("attn_q_bias", n_q, True), ("attn_k_bias", n_k, True), ("attn_v_bias", n_v, True)):
        a = getattr(L, name)
        if (a is None and not optional) or (a is not None and a.shape != (size,)):
            problems.append(f"{name} is {None if a is None else a.shape}, the block needs ({size},)")
    n_head = n_q // hd_k if hd_k else 0
    if (vc.shape[1] != n_kv or n_kv * hd_k != n_k or n_kv * hd_v != n_v or n_head * hd_k != n_q
            or not n_kv or n_head % n_kv or n_head * hd_v != n_att or s.h.shape[1] != n_embd
            or s.o.shape[1] != n_embd or s.up.shape[1] != n_ff
            or min(getattr(s, k).shape[0] for k in ("h", "q", "k", "v", "a", "o", "gate", "up")) < x.shape[0]):
        problems.append(f"the KV cache ({n_kv} heads of {hd_k} / {hd_v}) and the activations (q {n_q}, "
                        f"k {n_k}, v {n_v}, attention {n_att}, n_embd {n_embd}, n_ff {n_ff}) disagree")
    if problems:
        raise ModelShapeError("a transformer block's shapes disagree: " + "; ".join(problems))
