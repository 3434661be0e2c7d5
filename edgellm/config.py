"""Model hyperparameters, read once from GGUF metadata into a frozen dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgellm.errors import MissingMetadataError, UnsupportedArchitectureError


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # general.architecture
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int  # key_length
    head_dim_v: int  # value_length
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    n_rot: int  # rope.dimension_count
    rope_freq_base: float
    rope_freq_scale: float  # 1 / rope.scaling.factor for linear scaling
    rope_freq_base_swa: float  # rope base of sliding-window layers (gemma3: 10000)
    rms_eps: float
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: uses the sliding window
    tied_output: bool  # output head is token_embd
    file_type: int | None = None
    n_merges: int = 0  # BPE merges in the vocabulary (the tokenizer's memory grows with them)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_embd_k_gqa(self) -> int:
        return self.head_dim_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.head_dim_v * self.n_head_kv

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        """Build from a GGUFFile's metadata and tensor table; the architecture module supplies its
        defaults (SWA pattern, rope base of sliding layers) through `models.arch_defaults`."""
        from edgellm.models import architecture

        md = gf.metadata
        arch = gf.architecture
        module = architecture(arch, path=gf.path)  # raises UnsupportedArchitectureError

        def get(key: str, default: Any = ...) -> Any:
            full = f"{arch}.{key}"
            if full in md:
                return md[full]
            if default is ...:
                raise MissingMetadataError(f"{gf.path}: required metadata key '{full}' is missing")
            return default

        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        if n_head <= 0 or n_embd <= 0:
            raise MissingMetadataError(f"{gf.path}: '{arch}.attention.head_count' / embedding_length must be > 0")
        n_head_kv = get("attention.head_count_kv", n_head)
        n_layer = int(get("block_count"))
        head_dim_k = int(get("attention.key_length", n_embd // n_head))
        head_dim_v = int(get("attention.value_length", n_embd // n_head))
        tokens = md.get("tokenizer.ggml.tokens")
        n_vocab = int(get("vocab_size", len(tokens) if tokens is not None else 0))
        if n_vocab <= 0:
            raise MissingMetadataError(f"{gf.path}: cannot tell the vocabulary size ('{arch}.vocab_size' or tokens)")
        scaling_type = get("rope.scaling.type", "none")
        factor = float(get("rope.scaling.factor", 1.0) or 1.0)
        freq_scale = 1.0 / factor if scaling_type == "linear" and factor > 0 else 1.0
        sliding_window = int(get("attention.sliding_window", 0) or 0)
        swa_layers = module.swa_layers(n_layer, sliding_window, md)
        if hasattr(n_head_kv, "__len__"):  # per-layer arrays exist in some files; edgellm needs one value
            n_head_kv = int(n_head_kv[0])
        n_head_kv = int(n_head_kv)
        if n_head_kv <= 0 or n_head % n_head_kv:
            raise MissingMetadataError(f"{gf.path}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        return cls(
            arch=arch,
            name=str(md.get("general.name", gf.path.stem)),
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_ff=int(get("feed_forward_length")),
            n_vocab=n_vocab,
            n_ctx_train=int(get("context_length", 2048)),
            n_rot=int(get("rope.dimension_count", head_dim_k)),
            rope_freq_base=float(get("rope.freq_base", 10000.0)),
            rope_freq_scale=freq_scale,
            rope_freq_base_swa=float(get("rope.freq_base_swa", module.ROPE_FREQ_BASE_SWA)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            sliding_window=sliding_window,
            swa_layers=swa_layers,
            tied_output="output.weight" not in gf.tensors,
            file_type=md.get("general.file_type"),
            n_merges=len(md.get("tokenizer.ggml.merges") or ()),
        )

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_k)
