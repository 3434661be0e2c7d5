"""Model hyperparameters, read once from GGUF metadata into a frozen dataclass."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


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
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the arch's own (Model.hparams)

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
        defaults (SWA pattern, rope base of sliding layers) through `models.arch_defaults`.

        Every value is type- and range-checked (`validate.Metadata`), the hyperparameters against
        each other, and then the tensors against them (`validate.check_tensors`): a file that
        passes cannot hand a kernel a shape it does not expect. Errors name the key and file."""
        from edgellm.errors import printable
        from edgellm.models import architecture
        from edgellm.validate import Metadata, check_tensors, check_tokenizer

        md = gf.metadata
        arch = gf.architecture
        module = architecture(arch, path=gf.path)  # raises UnsupportedArchitectureError
        m = Metadata(md, gf.path, arch)
        n_tokens = check_tokenizer(md, gf.path)

        n_embd = m.integer("embedding_length")
        n_layer = m.integer("block_count")
        n_head = m.per_layer("attention.head_count", n_layer)
        n_head_kv = m.per_layer("attention.head_count_kv", n_layer, n_head)
        if n_head_kv > n_head or n_head % n_head_kv:
            raise m.bad("attention.head_count_kv", n_head_kv,
                        f"a divisor of {arch}.attention.head_count ({n_head})")
        head_dim_k = m.integer("attention.key_length", n_embd // n_head)
        head_dim_v = m.integer("attention.value_length", n_embd // n_head)
        n_rot = m.integer("rope.dimension_count", head_dim_k)
        if n_rot % 2 or n_rot < 2 or n_rot > head_dim_k:
            raise m.bad("rope.dimension_count", n_rot,
                        f"an even number in 2..{head_dim_k} (the key length: rope rotates pairs "
                        "within a head)")
        n_vocab = m.integer("vocab_size", n_tokens or ...)
        if n_tokens and n_vocab != n_tokens:
            raise m.bad("vocab_size", n_vocab, f"the number of tokens, {n_tokens}")
        scaling_type = m.string("rope.scaling.type", "none")
        factor = m.raw("rope.scaling.factor", 1.0)
        factor = 1.0 if type(factor) in (int, float) and factor == 0 else m.number("rope.scaling.factor", 1.0)
        freq_scale = 1.0 / factor if scaling_type == "linear" else 1.0
        freq_base = m.number("rope.freq_base", 10000.0)
        freq_base_swa = m.number("rope.freq_base_swa", module.Model.ROPE_FREQ_BASE_SWA or freq_base)
        for key, base in (("rope.freq_base", freq_base), ("rope.freq_base_swa", freq_base_swa)):
            _check_rope_angles(m, key, base, "rope.scaling.factor", factor, freq_scale, n_rot)
        sliding_window = m.integer("attention.sliding_window", module.Model.SLIDING_WINDOW, lo=0)
        cfg = cls(
            arch=arch,
            name=printable(m.string("general.name", gf.path.stem)),  # escaped: shown as is everywhere
            n_layer=n_layer,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim_k=head_dim_k,
            head_dim_v=head_dim_v,
            n_ff=m.per_layer("feed_forward_length", n_layer),
            n_vocab=n_vocab,
            n_ctx_train=m.integer("context_length", 2048),
            n_rot=n_rot,
            rope_freq_base=freq_base,
            rope_freq_scale=freq_scale,
            rope_freq_base_swa=freq_base_swa,
            rms_eps=m.number("attention.layer_norm_rms_epsilon", 1e-5, hi=1.0),
            sliding_window=sliding_window,
            swa_layers=(),  # set once check_tensors has bounded n_layer by the file's blocks
            tied_output="output.weight" not in gf.tensors,
            file_type=m.integer("general.file_type", None, lo=0) if "general.file_type" in md else None,
            n_merges=len(md.get("tokenizer.ggml.merges") or ()),
            extra=module.Model.hparams(m),  # (the expected tensor shapes may depend on them)
        )
        check_tensors(gf, cfg, module.Model)  # also bounds n_layer by the blocks in the file
        return replace(cfg, swa_layers=tuple(module.Model.swa_layers(n_layer, sliding_window, md)))

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_k)


ROPE_MAX_POS = 1 << 24  # positions the RoPE angles must stay finite for (far past any context)
_LOG_F32_MAX = math.log(float(np.finfo(np.float32).max))


def _check_rope_angles(m, base_key: str, base: float, scale_key: str, factor: float, freq_scale: float,
                       n_rot: int) -> None:
    """RoPE's float32 angles p * base^(-2i/n_rot) * freq_scale (i < n_rot/2) must be finite for every
    position up to ROPE_MAX_POS: a tiny base or scaling factor (a hostile file) overflowed them to
    inf, and NumPy printed a RuntimeWarning and the model produced NaN. Checked in log space (the
    powers themselves may overflow a float)."""
    log_steps = max(0.0, (n_rot // 2 - 1) * (-2.0 / n_rot) * math.log(base))
    log_scale = math.log(freq_scale)
    if math.log(ROPE_MAX_POS) + log_steps + log_scale < _LOG_F32_MAX:
        return
    if log_scale >= log_steps:
        raise m.bad(scale_key, factor, "a factor that keeps RoPE's float32 angles finite "
                    f"(>= {ROPE_MAX_POS * math.exp(log_steps - _LOG_F32_MAX):.3g} for this file)")
    raise m.bad(base_key, base, "a base that keeps RoPE's float32 angles finite")
