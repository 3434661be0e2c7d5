"""Which type each tensor gets: llama.cpp's quantization recipes (llama-quant.cpp), as data + rules.

A file type (Q4_K_M, Q3_K_S, ...) names a default tensor type and a mix: the output head (and a tied
token embedding) gets Q6_K, attention V and FFN down get more bits in some layers, and so on. A
tensor whose rows do not split into the chosen type's blocks falls back to a type whose blocks fit.
Tensors are visited in llama.cpp's order (non-block tensors first, then by layer, names sorted
within a layer), because the per-layer rules count attention-V tensors as they go.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as FT

from edgellm.errors import InvalidArgumentError

# name -> (general.file_type, default tensor type); llama-quantize's names
FILE_TYPES: dict[str, tuple[FT, T]] = {
    "F32": (FT.ALL_F32, T.F32),
    "F16": (FT.MOSTLY_F16, T.F16),
    "BF16": (FT.MOSTLY_BF16, T.BF16),
    "Q8_0": (FT.MOSTLY_Q8_0, T.Q8_0),
    "Q6_K": (FT.MOSTLY_Q6_K, T.Q6_K),
    "Q5_K_M": (FT.MOSTLY_Q5_K_M, T.Q5_K),
    "Q5_K_S": (FT.MOSTLY_Q5_K_S, T.Q5_K),
    "Q5_1": (FT.MOSTLY_Q5_1, T.Q5_1),
    "Q5_0": (FT.MOSTLY_Q5_0, T.Q5_0),
    "Q4_K_M": (FT.MOSTLY_Q4_K_M, T.Q4_K),
    "Q4_K_S": (FT.MOSTLY_Q4_K_S, T.Q4_K),
    "Q4_1": (FT.MOSTLY_Q4_1, T.Q4_1),
    "Q4_0": (FT.MOSTLY_Q4_0, T.Q4_0),
    "Q3_K_L": (FT.MOSTLY_Q3_K_L, T.Q3_K),
    "Q3_K_M": (FT.MOSTLY_Q3_K_M, T.Q3_K),
    "Q3_K_S": (FT.MOSTLY_Q3_K_S, T.Q3_K),
    "Q2_K": (FT.MOSTLY_Q2_K, T.Q2_K),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
# A block type whose rows do not fit falls back to a 32-weight type (then to F16 if that fails too)
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
# 2-D weights llama.cpp never quantizes (substrings of the name)
NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight",
    "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight",
    "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight", "time_mix_g2.weight",
    "time_mix_decay_w1.weight", "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight",
)
NEVER_QUANTIZED_EXACT = ("position_embd.weight", "token_types.weight")


# the tensor types edgellm's quantizer writes (llama-quantize's bytes)
ENCODABLE = (*FLOAT_TYPES, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def parse_type(name: str, what: str = "TYPE") -> str:
    key = name.upper()
    if key not in FILE_TYPES:
        raise InvalidArgumentError(f"unknown {what} {name!r}; use one of {', '.join(FILE_TYPES)}")
    return key


def parse_tensor_type(name: str, what: str) -> T:
    """A single tensor type (--output-type, --token-embedding-type): F32, F16, Q8_0, Q6_K, Q4_K..."""
    names = ", ".join(t.name for t in ENCODABLE)
    t = T.__members__.get(name.upper())
    if t is None:
        raise InvalidArgumentError(f"unknown {what} {name!r}; use one of {names}")
    if t not in ENCODABLE:  # edgellm runs the IQ types but has no encoder of llama.cpp's for them
        raise InvalidArgumentError(f"{what} {t.name}: edgellm does not quantize to {t.name}; use one of {names}")
    return t


# ============================================================================ tensor order, category
def layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """llama.cpp's loader order: non-block tensors first, then by layer; by name within a layer."""
    return sorted(names, key=lambda n: (layer_of(n), n.encode("utf-8", "surrogateescape")))


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def n_dims(ne: tuple[int, ...]) -> int:
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return n


def allows_quantization(name: str, ne: tuple[int, ...], leave_output: bool) -> bool:
    if n_dims(ne) < 2 or not name.endswith("weight"):
        return False
    if leave_output and name == "output.weight":
        return False
    if name in NEVER_QUANTIZED_EXACT:
        return False
    return not any(s in name for s in NEVER_QUANTIZED)


# ============================================================================ the rules
@dataclass
class Model:
    """What the rules read from the file's metadata."""

    arch: str
    n_layer: int
    n_gqa: int = 1  # n_head / n_head_kv
    n_expert: int = 0
    is_70b: bool = False

    @classmethod
    def from_metadata(cls, md: dict) -> "Model":
        arch = str(md.get("general.architecture", ""))

        def get(key, default):
            v = md.get(f"{arch}.{key}", default)
            v = v[0] if hasattr(v, "__len__") and len(v) else v  # per-layer arrays: layer 0
            return int(v)

        n_layer = get("block_count", 0)
        n_head, n_kv = get("attention.head_count", 1), get("attention.head_count_kv", 0)
        n_kv = n_kv or n_head
        return cls(arch, n_layer, n_head // n_kv if n_kv else 1, get("expert_count", 0),
                   arch == "llama" and n_layer == 80 and n_head != n_kv)


@dataclass
class Options:
    pure: bool = False
    leave_output: bool = False
    output_type: T | None = None
    token_embedding_type: T | None = None


@dataclass
class _Counters:
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    tied: bool = True
    fallbacks: list = field(default_factory=list)


def use_more_bits(i: int, n: int) -> bool:
    q = i - n // 8
    return i < n // 8 or i >= 7 * n // 8 or (q - 3 * int(q / 3)) == 2  # C's % (truncating)


def _mix(c: _Counters, m: Model, ft: str, name: str, ne, cat: str, t: T, opt: Options) -> T:
    """llama.cpp's llama_tensor_get_type_impl for the file types above."""
    falcon = m.arch == "falcon"
    if cat == "output" or (c.tied and cat == "token_embd"):
        if opt.output_type is not None:
            return opt.output_type
        from edgellm.quants import QUANT_TYPES

        if falcon or ne[0] % QUANT_TYPES[t].block_size:
            return T.Q8_0
        return T.Q6_K if t != T.Q8_0 else t
    if cat == "token_embd":
        return opt.token_embedding_type if opt.token_embedding_type is not None else t
    if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        i, n = c.i_attention_wv, c.n_attention_wv
        if ft == "Q2_K":
            t = T.Q4_K if m.n_gqa >= 4 else T.Q3_K
        elif ft == "Q3_K_M":
            t = T.Q5_K if i < 2 else T.Q4_K
        elif ft == "Q3_K_L":
            t = T.Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            t = T.Q6_K
        elif ft == "Q4_K_S" and i < 4:
            t = T.Q5_K
        if m.is_70b and t in (T.Q3_K, T.Q4_K):
            t = T.Q5_K
        if m.n_expert == 8:
            t = T.Q8_0
        c.i_attention_wv += 1
        return t
    if cat == "attn_k":
        return T.Q8_0 if m.n_expert == 8 else t
    if cat == "ffn_down":
        i, n = _layer_info(c.i_ffn_down, m, name)
        if ft == "Q2_K":
            t = T.Q3_K
        elif ft == "Q3_K_M":
            t = T.Q5_K if i < n // 16 else T.Q4_K if (not falcon or use_more_bits(i, n)) else T.Q3_K
        elif ft == "Q3_K_L":
            t = T.Q4_K if falcon else T.Q5_K
        elif ft == "Q4_K_M":
            if falcon:
                t = T.Q6_K if i < n // 16 else T.Q5_K if use_more_bits(i, n) else T.Q4_K
            elif use_more_bits(i, n):
                t = T.Q6_K
        elif ft == "Q5_K_M" and use_more_bits(i, n):
            t = T.Q6_K
        elif ft == "Q4_K_S" and not falcon and i < n // 8:
            t = T.Q5_K
        c.i_ffn_down += 1
        return t
    if cat == "attn_output":
        if falcon:
            return T.Q4_K if ft == "Q3_K_L" else t
        if m.n_expert == 8:
            return T.Q5_K if ft in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M") else t
        return {"Q2_K": T.Q3_K, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K}.get(ft, t)
    if cat == "ffn_gate":
        _layer_info(c.i_ffn_gate, m, name)
        c.i_ffn_gate += 1
    elif cat == "ffn_up":
        _layer_info(c.i_ffn_up, m, name)
        c.i_ffn_up += 1
    return t


def _layer_info(i: int, m: Model, name: str) -> tuple[int, int]:
    if m.n_expert > 1:
        i = layer_of(name)
        if not 0 <= i < m.n_layer:
            raise InvalidArgumentError(f"cannot tell the layer of tensor {name!r} (expected blk.N. with N < {m.n_layer})")
    return i, m.n_layer


def _fallback(c: _Counters, name: str, ne, t: T) -> T:
    from edgellm.quants import QUANT_TYPES

    n_cols = ne[0]
    if n_cols % QUANT_TYPES[t].block_size == 0:
        return t
    new = FALLBACK.get(t, t)
    if n_cols % QUANT_TYPES[new].block_size:
        new = T.F16
    c.fallbacks.append((name, t, new))
    return new


def plan_types(tensors: list[tuple[str, tuple[int, ...], T]], file_type: str, model: Model,
               opt: Options) -> tuple[dict[str, T], list]:
    """[(name, ne, current type)] in llama.cpp's order -> ({name: new type}, fallbacks
    [(name, wanted, got)])."""
    default = FILE_TYPES[file_type][1]
    c = _Counters()
    for name, _, _ in tensors:
        cat = category(name)
        c.n_attention_wv += cat in ("attn_v", "attn_qkv", "attn_kv_b")
        c.tied &= cat != "output"
    out = {}
    for name, ne, cur in tensors:
        if not allows_quantization(name, ne, opt.leave_output):
            out[name] = cur
            continue
        cat = category(name)
        if opt.token_embedding_type is not None and cat == "token_embd":
            out[name] = opt.token_embedding_type
            continue
        if opt.output_type is not None and cat == "output":
            out[name] = opt.output_type
            continue
        t = default
        if t not in FLOAT_TYPES:
            if not opt.pure:
                t = _mix(c, model, file_type, name, ne, cat, t, opt)
            t = _fallback(c, name, ne, t)
        out[name] = t
    return out, c.fallbacks
