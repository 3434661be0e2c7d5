"""Synthetic GGUF files: real llama.cpp layouts filled with random weights, for tests and benchmarks.

`write_synthetic_gguf` writes the tensor names, shapes and metadata keys llama.cpp's loader reads for
llama, qwen2, qwen3 and gemma3, a small but complete GPT-2-style BPE tokenizer and a ChatML template.
Weights are random with a scale that keeps activations O(1) (so logits are not degenerate), quantized to
the requested type. With `sparse=True` the header is real and the tensor data is a hole in the file: a
Llama-2-7B-shaped file takes no disk and is written in milliseconds, which is all the planner needs.

Order of this file: tokenizer → tensor table per architecture → K-quant encoders (gguf-py only encodes
the legacy types) → writer.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GGMLType
from gguf import GGUFWriter, LlamaFileType, TokenType

from edgellm.errors import InvalidArgumentError
from edgellm.models import ARCHITECTURES as _ARCH_MODULES
from edgellm.models import architecture
from edgellm.quants import KVALUES_IQ4NL, QK_K, QUANT_TYPES

# the architectures with a module of their own (aliases write the same file as their module's)
ARCHITECTURES = tuple(name for name, module in _ARCH_MODULES.items() if name == module)


def _model(arch: str):
    """The architecture's Decoder class: what its files carry (FILE_* attributes)."""
    return architecture(arch).Model


# ============================================================================ tokenizer
def bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, as a list indexed by byte value.

    Printable Latin-1 bytes map to themselves; the other 68 bytes map to U+0100 upwards, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# A few merges in GPT-2 notation ("Ġ" is the space byte); each merge's result is a token.
MERGES = ("Ġ t", "h e", "i n", "Ġ a", "e r", "o n", "Ġt he", "r e", "Ġ s", "a t", "e n", "Ġ w")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_vocab(n_vocab: int) -> tuple[list[str], list[int]]:
    """Token strings and token types: 256 byte tokens (in GPT-2's byte order, so byte b is token b),
    the merged tokens, the three ChatML specials (CONTROL), then unused padding up to n_vocab."""
    tokens = bytes_to_unicode() + ["".join(m.split(" ")) for m in MERGES] + list(SPECIAL_TOKENS)
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [TokenType.CONTROL] * len(SPECIAL_TOKENS)
    if n_vocab < len(tokens):
        raise InvalidArgumentError(f"n_vocab={n_vocab} is too small: the synthetic tokenizer has {len(tokens)} tokens")
    n_pad = n_vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(n_pad)]
    types += [TokenType.UNUSED] * n_pad
    return tokens, [int(t) for t in types]


# ============================================================================ tensor table
@dataclass(frozen=True)
class Shape:
    """The model dimensions every architecture's tensor table is built from."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int


def tensor_table(arch: str, s: Shape, tied_output: bool,
                 hparams: Mapping | None = None) -> list[tuple[str, tuple[int, ...], str]]:
    """[(name, numpy shape (rows first), kind)]; kind "matrix" | "embd" | "norm" | "bias" | "router"
    (F32, never quantized). hparams: the architecture's own keys over its FILE_HPARAMS (a
    mixture-of-experts file's expert count and width)."""
    n_q, n_kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    sizes = {"q_bias": n_q, "kv_bias": n_kv, "head_norm": s.head_dim, "embd_norm": s.n_embd,
             "q_norm_whole": n_q, "kv_norm_whole": n_kv}
    model = _model(arch)
    hp = {**model.FILE_HPARAMS, **(hparams or {})}
    n_exp, ff_exp = hp.get("expert_count", 0), hp.get("expert_feed_forward_length", 0)
    ff_sh = hp.get("expert_shared_feed_forward_length") or s.n_ff
    table = [("token_embd.weight", (s.n_vocab, s.n_embd), "embd")]
    for i in range(s.n_layer):
        b = f"blk.{i}."
        up_rows = s.n_ff if "ffn_gate" in model.BLOCK_REQUIRED else 2 * s.n_ff  # without a gate: gate and up
        table += [t for t in [
            (b + "attn_norm.weight", (s.n_embd,), "norm"),
            (b + "attn_qkv.weight", (n_q + 2 * n_kv, s.n_embd), "matrix"),  # wq, wk, wv in one (phi3)
            (b + "attn_q.weight", (n_q, s.n_embd), "matrix"),  # wq (n_head*head_dim, n_embd)
            (b + "attn_k.weight", (n_kv, s.n_embd), "matrix"),  # wk (n_head_kv*head_dim, n_embd)
            (b + "attn_v.weight", (n_kv, s.n_embd), "matrix"),  # wv (n_head_kv*head_dim, n_embd)
            (b + "attn_output.weight", (s.n_embd, n_q), "matrix"),  # wo (n_embd, n_head*head_dim)
            (b + "ffn_norm.weight", (s.n_embd,), "norm"),
            (b + "ffn_gate.weight", (s.n_ff, s.n_embd), "matrix"),  # (n_ff, n_embd)
            (b + "ffn_up.weight", (up_rows, s.n_embd), "matrix"),  # (n_ff, n_embd)
            (b + "ffn_down.weight", (s.n_embd, s.n_ff), "matrix"),  # (n_embd, n_ff)
            (b + "ffn_gate_inp.weight", (n_exp, s.n_embd), "router"),  # experts' router (n_expert, n_embd)
            (b + "ffn_gate_exps.weight", (n_exp, ff_exp, s.n_embd), "matrix"),  # expert e: (n_ff_exp, n_embd)
            (b + "ffn_up_exps.weight", (n_exp, ff_exp, s.n_embd), "matrix"),
            (b + "ffn_down_exps.weight", (n_exp, s.n_embd, ff_exp), "matrix"),  # expert e: (n_embd, n_ff_exp)
            (b + "ffn_gate_inp_shexp.weight", (s.n_embd,), "router"),  # the shared expert's gate (qwen2moe)
            (b + "ffn_gate_shexp.weight", (ff_sh, s.n_embd), "matrix"),
            (b + "ffn_up_shexp.weight", (ff_sh, s.n_embd), "matrix"),
            (b + "ffn_down_shexp.weight", (s.n_embd, ff_sh), "matrix"),
        ] if t[0][len(b):-len(".weight")] in model.BLOCK_REQUIRED]  # (a post-norm block has no pre-norms)
        for suffix, kind in model.FILE_TENSORS:
            table.append((b + suffix, (sizes[kind],), "bias" if kind.endswith("bias") else "norm"))
    table.append(("output_norm.weight", (s.n_embd,), "norm"))
    if not tied_output:
        table.append(("output.weight", (s.n_vocab, s.n_embd), "matrix"))
    return table


# Row widths a block type cannot split fall back like llama.cpp's quantizer does (llama-quant.cpp):
# Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; Q2_K / Q3_K go to IQ4_NL there and to
# Q4_0 here (the same 4.5 bits per weight; the files written before edgellm ran IQ4_NL stay the
# same); a legacy type that does not fit either -> F16.
FALLBACK = {
    GGMLType.IQ4_XS: GGMLType.IQ4_NL,
    GGMLType.Q2_K: GGMLType.Q4_0,
    GGMLType.Q3_K: GGMLType.Q4_0,
    GGMLType.Q4_K: GGMLType.Q5_0,
    GGMLType.Q5_K: GGMLType.Q5_1,
    GGMLType.Q6_K: GGMLType.Q8_0,
}


def storage_type(ggml_type: GGMLType, n_cols: int) -> GGMLType:
    """The type a row of n_cols weights is stored in when `ggml_type` is asked for."""
    while n_cols % QUANT_TYPES[ggml_type].block_size:
        ggml_type = FALLBACK.get(ggml_type, GGMLType.F16)
    return ggml_type


# ============================================================================ K-quant encoders
# gguf-py dequantizes every K-quant but encodes none, so these are simple, valid encoders (min/max
# scales, round to nearest; not llama.cpp's error-minimizing search). Each returns uint8
# (n_blocks, type_size) in the layout QUANT_TYPES[...].layout draws; tests decode them with gguf-py.

def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _pack(values: np.ndarray, n_bytes: int, byte_of: np.ndarray, shift_of: np.ndarray) -> np.ndarray:
    """OR the small integers values[:, e] << shift_of[e] into byte byte_of[e] of each row."""
    out = np.zeros((values.shape[0], n_bytes), dtype=np.uint8)
    for shift in np.unique(shift_of):
        sel = shift_of == shift  # within one shift every element has its own byte
        out[:, byte_of[sel]] |= (values[:, sel].astype(np.uint8) << np.uint8(shift)).astype(np.uint8)
    return out


def _affine_sub_blocks(x: np.ndarray, sub: int, q_max: int, scale_bits: int):
    """x (n, 256) -> (q (n, 256), sc, mn (n, 256/sub) integers, d, dmin (n,) float16) with
    x ≈ d*sc*q - dmin*mn per sub-block of `sub` weights (Q2_K, Q4_K, Q5_K)."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    lo = np.minimum(xs.min(axis=2), 0.0)  # the min term only ever subtracts
    scale = (xs.max(axis=2) - lo) / q_max
    s_max = (1 << scale_bits) - 1
    d = (scale.max(axis=1) / s_max).astype(np.float16)
    dmin = (-lo.min(axis=1) / s_max).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])).clip(0, s_max)
        mn = np.nan_to_num(np.rint(-lo / dmin.astype(np.float32)[:, None])).clip(0, s_max)
        step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
        offset = (dmin.astype(np.float32)[:, None] * mn)[:, :, None]
        q = np.nan_to_num(np.rint((xs + offset) / step)).clip(0, q_max)
    return q.reshape(n, QK_K).astype(np.uint8), sc.astype(np.uint8), mn.astype(np.uint8), d, dmin


def _symmetric_sub_blocks(x: np.ndarray, sub: int, q_lo: int, q_hi: int, scale_max: int):
    """x (n, 256) -> (q (n, 256) in [q_lo, q_hi], sc (n, 256/sub) in [0, scale_max], d (n,) float16)
    with x ≈ d*sc*q (Q3_K, Q6_K)."""
    n = x.shape[0]
    xs = x.reshape(n, -1, sub)
    scale = np.abs(xs).max(axis=2) / -q_lo
    d = (scale.max(axis=1) / scale_max).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])).clip(0, scale_max)
        step = (d.astype(np.float32)[:, None] * sc)[:, :, None]
        q = np.nan_to_num(np.rint(xs / step)).clip(q_lo, q_hi)
    return q.reshape(n, QK_K).astype(np.int16), sc.astype(np.uint8), d


_E = np.arange(QK_K)  # element index inside a super-block


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins -> 12 bytes (Q4_K / Q5_K): bytes 0-3 = sc[0:4] | sc[4:8]>>4 << 6,
    4-7 = mn[0:4] | mn[4:8]>>4 << 6, 8-11 = sc[4:8] & 15 | (mn[4:8] & 15) << 4."""
    return np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    ).astype(np.uint8)


def encode_q2_k(x: np.ndarray) -> np.ndarray:
    q, sc, mn, d, dmin = _affine_sub_blocks(x, 16, 3, 4)
    # element e = h*128 + j*32 + l sits in qs[h*32 + l], bits 2j
    qs = _pack(q, QK_K // 4, (_E // 128) * 32 + _E % 32, 2 * ((_E % 128) // 32))
    return np.concatenate([sc | (mn << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def encode_q3_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric_sub_blocks(x, 16, -4, 3, 31)
    u = (q + 4).astype(np.uint8)  # 0..7: low 2 bits in qs, bit 2 in hmask (set means q >= 0)
    hmask = _pack(u >> 2, QK_K // 8, _E % 32, _E // 32)  # element e: hmask[e % 32], bit e // 32
    qs = _pack(u & 3, QK_K // 4, (_E // 128) * 32 + _E % 32, 2 * ((_E % 128) // 32))
    s = (sc.astype(np.int16) + 32).astype(np.uint8)  # stored biased by 32; low nibbles then 2-bit highs
    i = np.arange(16)
    low = _pack(s & 0xF, 8, i % 8, 4 * (i // 8))
    high = _pack(s >> 4, 4, i % 4, 2 * (i // 4))
    return np.concatenate([hmask, qs, low, high, _f16_bytes(d)], axis=1)


def encode_q4_k(x: np.ndarray) -> np.ndarray:
    q, sc, mn, d, dmin = _affine_sub_blocks(x, 32, 15, 6)
    qs = _pack(q, QK_K // 2, (_E // 64) * 32 + _E % 32, 4 * ((_E % 64) // 32))
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qs], axis=1)


def encode_q5_k(x: np.ndarray) -> np.ndarray:
    q, sc, mn, d, dmin = _affine_sub_blocks(x, 32, 31, 6)
    qh = _pack(q >> 4, QK_K // 8, _E % 32, _E // 32)
    qs = _pack(q & 0xF, QK_K // 2, (_E // 64) * 32 + _E % 32, 4 * ((_E % 64) // 32))
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn), qh, qs], axis=1)


def encode_q6_k(x: np.ndarray) -> np.ndarray:
    q, sc, d = _symmetric_sub_blocks(x, 16, -32, 31, 127)
    u = (q + 32).astype(np.uint8)  # 0..63
    r = _E % 128  # element e = h*128 + r: low nibble in ql[h*64 + r%64] (nibble r//64),
    h = _E // 128  # high 2 bits in qh[h*32 + r%32] at bit 2*(r//32)
    ql = _pack(u & 0xF, QK_K // 2, h * 64 + r % 64, 4 * (r // 64))
    qh = _pack(u >> 4, QK_K // 4, h * 32 + r % 32, 2 * (r // 32))
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


# ============================================================================ IQ4 encoders
# The same kind of simple encoder for IQ4_NL / IQ4_XS (gguf-py decodes them, encodes neither): the
# scale from the value of largest magnitude (it maps to the code of -127), every weight to the code
# of the nearest of the 16 non-linear values. Not llama.cpp's search for the best scale.
_KVALUES = np.array(KVALUES_IQ4NL, dtype=np.float32)


def _iq4_codes(x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """x (n, k), block scales d float32 (n,) -> (n, k) codes 0..15 of the nearest values x / d."""
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.nan_to_num(x / d[:, None])
    return np.abs(y[..., None] - _KVALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_nibbles(q: np.ndarray) -> np.ndarray:
    """(n, 32) codes -> (n, 16) bytes: code j in the low nibble of byte j, code j + 16 in the high."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def _signed_amax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def encode_iq4_nl(x: np.ndarray) -> np.ndarray:
    """x (n, 32) -> (n, 18): d:f16 | qs[16]; w = d * kvalues[q]."""
    d = (_signed_amax(x) / np.float32(-127)).astype(np.float16)
    q = _iq4_codes(x, d.astype(np.float32))
    return np.concatenate([_f16_bytes(d), _iq4_nibbles(q)], axis=1)


def encode_iq4_xs(x: np.ndarray) -> np.ndarray:
    """x (n, 256) -> (n, 136): d:f16 | scales_h:u16 | scales_l[4] | qs[128]; sub-block s has the
    6-bit scale ls (stored ls, used as ls - 32: low 4 bits in nibble s % 2 of scales_l[s // 2], high
    2 bits at bit 2s of scales_h) and w = d * (ls - 32) * kvalues[q]."""
    n = x.shape[0]
    xs = x.reshape(n, 8, 32)
    scale = _signed_amax(xs) / np.float32(-127)  # (n, 8) wanted sub-block scales, either sign
    d = (np.abs(scale).max(axis=1) / np.float32(31)).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])).clip(-32, 31).astype(np.int32) + 32
    dl = d.astype(np.float32)[:, None] * (ls - 32).astype(np.float32)  # (n, 8)
    q = _iq4_codes(xs.reshape(n * 8, 32), dl.reshape(-1))
    s = np.arange(8)
    scales_h = ((ls >> 4) << (2 * s)).sum(axis=1).astype(np.uint16)
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    qs = _iq4_nibbles(q).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), scales_h.reshape(-1, 1).view(np.uint8), scales_l, qs], axis=1)


IQ4_ENCODERS = {GGMLType.IQ4_NL: (encode_iq4_nl, 32), GGMLType.IQ4_XS: (encode_iq4_xs, QK_K)}


K_ENCODERS = {
    GGMLType.Q2_K: encode_q2_k,
    GGMLType.Q3_K: encode_q3_k,
    GGMLType.Q4_K: encode_q4_k,
    GGMLType.Q5_K: encode_q5_k,
    GGMLType.Q6_K: encode_q6_k,
}


def quantize(x: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """float32 (n_rows, n_cols) -> the tensor as GGUFWriter takes it: float32/float16 arrays for
    F32/F16, uint8 (n_rows, row_bytes) for block types."""
    from gguf import quants

    x = np.ascontiguousarray(x, dtype=np.float32)
    if ggml_type in IQ4_ENCODERS:
        encode, block = IQ4_ENCODERS[ggml_type]
        n_rows, n_cols = x.shape
        return encode(x.reshape(-1, block)).reshape(n_rows, n_cols // block * QUANT_TYPES[ggml_type].type_size)
    encoder = K_ENCODERS.get(ggml_type)
    if encoder is None:
        return quants.quantize(x, ggml_type)
    n_rows, n_cols = x.shape
    return encoder(x.reshape(-1, QK_K)).reshape(n_rows, n_cols // QK_K * QUANT_TYPES[ggml_type].type_size)


# ============================================================================ writer
FILE_TYPES = {  # requested tensor type -> general.file_type (llama.cpp's LLAMA_FTYPE)
    GGMLType.F32: LlamaFileType.ALL_F32,
    GGMLType.F16: LlamaFileType.MOSTLY_F16,
    GGMLType.BF16: LlamaFileType.MOSTLY_BF16,
    GGMLType.Q4_0: LlamaFileType.MOSTLY_Q4_0,
    GGMLType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    GGMLType.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    GGMLType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    GGMLType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    GGMLType.Q3_K: LlamaFileType.MOSTLY_Q3_K_S,
    GGMLType.Q4_K: LlamaFileType.MOSTLY_Q4_K_S,
    GGMLType.Q5_K: LlamaFileType.MOSTLY_Q5_K_S,
    GGMLType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    GGMLType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL,
    GGMLType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
}


def _write_metadata(w: GGUFWriter, arch: str, s: Shape, ggml_type: GGMLType, n_ctx_train: int,
                    sliding_window: int, hparams: Mapping | None = None, name: str | None = None) -> None:
    model = _model(arch)
    w.add_name(name or f"synthetic-{arch}-{s.n_layer}x{s.n_embd}-{ggml_type.name}")
    w.add_type("model")
    w.add_file_type(int(FILE_TYPES[ggml_type]))
    w.add_quantization_version(2)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(model.FILE_RMS_EPS)
    w.add_rope_freq_base(model.FILE_ROPE_FREQ_BASE)
    if "rope.dimension_count" not in (hparams or {}):  # (partial rotary: given with hparams)
        w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.n_vocab)
    if model.FILE_KEY_LENGTH or s.head_dim != s.n_embd // s.n_head:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
    if model.FILE_SLIDING_WINDOW:
        # llama.cpp's gemma3 loader: sliding_window > 0 turns on SWA with the pattern "5 sliding
        # layers, then 1 global" unless attention.sliding_window_pattern says otherwise; sliding
        # layers use rope.freq_base_swa (default 10000), the global ones rope.freq_base.
        w.add_sliding_window(sliding_window)
        if model.ROPE_FREQ_BASE_SWA is not None:
            w.add_rope_freq_base_swa(model.ROPE_FREQ_BASE_SWA)

    for key, value in {**model.FILE_HPARAMS, **(hparams or {})}.items():
        if isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", value)

    tokens, types = tokenizer_vocab(s.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(_model(arch).FILE_TOKENIZER_PRE)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)


def _random_tensor(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """float32 weights whose scale keeps activations O(1): a matrix (n_out, n_in) ~ N(0, 1/n_in), so
    y = W x keeps the RMS of x; the embedding ~ N(0, 4/n_embd), so tied-output logits of an RMS-normed
    hidden state have a standard deviation of about 2 (a peaked, not one-hot, softmax); norms ≈ 1."""
    if kind == "norm":
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if kind == "bias":
        return (0.02 * rng.standard_normal(shape)).astype(np.float32)
    scale = (2.0 if kind == "embd" else 1.0) / np.sqrt(shape[-1])
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def write_synthetic_gguf(
    path: str | os.PathLike,
    *,
    arch: str = "llama",
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    head_dim: int | None = None,
    ggml_type: GGMLType = GGMLType.Q4_K,
    tied_output: bool = True,
    n_ctx_train: int = 2048,
    sliding_window: int = 512,
    seed: int = 0,
    sparse: bool = False,
    tensor_types: Mapping[str, GGMLType] | None = None,
    f32_tensors: Mapping[str, np.ndarray] | None = None,
    hparams: Mapping[str, int | float] | None = None,
    name: str | None = None,
) -> Path:
    """Write a GGUF file of the given architecture and shape; returns its path.

    2-D weights are stored as `ggml_type` (or its fallback where a row does not split into blocks,
    see `storage_type`), norms and biases as F32. `sliding_window` is used by gemma3 only.
    `sparse=True`: nothing is generated or quantized; the tensor data region is left as a hole.
    `tensor_types`: a type per tensor name for the weights that are not to be `ggml_type` (with the
    same fallback), as a mixed file (Q4_K_M) has. `f32_tensors`: more tensors stored as F32 (name ->
    values), e.g. llama 3's rope_freqs. `hparams`: the architecture's own keys (`<arch>.<key>`,
    ints as uint32, floats as float32) over its FILE_HPARAMS. `name`: general.name (llama.cpp sets
    token attributes by it: a "phi3" name wants Phi-3's vocabulary).
    """
    if arch not in ARCHITECTURES:
        raise InvalidArgumentError(f"arch={arch!r} is not one of {', '.join(ARCHITECTURES)}")
    ggml_type = GGMLType(ggml_type)
    if ggml_type not in FILE_TYPES:
        raise InvalidArgumentError(
            f"ggml_type {ggml_type.name} is not supported; use one of {', '.join(t.name for t in FILE_TYPES)}"
        )
    head_dim = head_dim or n_embd // n_head
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab, head_dim) <= 0 or n_head % n_head_kv:
        raise InvalidArgumentError("all dimensions must be > 0 and n_head a multiple of n_head_kv")
    shape = Shape(n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    w = GGUFWriter(path, arch)
    _write_metadata(w, arch, shape, ggml_type, n_ctx_train, sliding_window, hparams, name)
    rng = np.random.default_rng(seed)
    data_bytes = 0
    for name, np_shape, kind in tensor_table(arch, shape, tied_output, hparams):
        asked = GGMLType((tensor_types or {}).get(name, ggml_type))
        if asked not in FILE_TYPES:
            raise InvalidArgumentError(f"{name}: type {asked.name} is not supported")
        qtype = storage_type(asked, np_shape[-1]) if kind in ("matrix", "embd") else GGMLType.F32
        if sparse:
            n_rows = int(np.prod(np_shape[:-1], dtype=np.int64))
            nbytes = n_rows * QUANT_TYPES[qtype].row_bytes(np_shape[-1])
            w.add_tensor_info(name, np_shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
            data_bytes += GGUFWriter.ggml_pad(nbytes, w.data_alignment)
        else:
            x = _random_tensor(rng, np_shape, kind)
            data = quantize(x.reshape(-1, np_shape[-1]), qtype).reshape(*np_shape[:-1], -1)
            w.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
    if f32_tensors and sparse:
        raise InvalidArgumentError("f32_tensors need their values: not with sparse=True")
    for name, values in (f32_tensors or {}).items():
        w.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    if not sparse:
        w.write_tensors_to_file()
        w.close()
        return path
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    fout.truncate(fout.tell() + data_bytes)  # the data region: a hole the file system does not store
    w.close()
    return path
