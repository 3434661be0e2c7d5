"""phi3 (Phi-3 / 3.5-mini, Phi-4-mini): the llama block with q, k, v in one tensor (attn_qkv) and
the FFN's gate and up in one (ffn_up: gate rows first, SwiGLU), neox RoPE over the first n_rot
dimensions of a head (partial rotary), LongRoPE — per-pair angle divisors, the "long" set when a
sequence's context (padded to 256) exceeds rope.scaling.original_context_length, else the "short"
one, and cos / sin times rope.scaling.attn_factor — q scaled by 1/sqrt(head_dim) after RoPE, and
no sliding window (llama.cpp ignores the key)."""
from types import SimpleNamespace

import numpy as np

from edgellm.models.decoder import BIASES, OPTIONAL, REQUIRED, Decoder

F32 = np.float32
CTX_PAD = 256  # llama.cpp pads a sequence's context to this before comparing it


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "silu"
    SCALE_Q = True
    BLOCK_REQUIRED = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
    BLOCK_OPTIONAL = ()
    BLOCK_BIASES = ()
    FILE_HPARAMS = {"rope.scaling.original_context_length": 4096}  # (attn_factor: 1 unless given)

    @staticmethod
    def block_shapes(cfg) -> dict[str, tuple[int, ...]]:
        n_qkv = (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim_k
        return {"attn_qkv": (cfg.n_embd, n_qkv), "ffn_up": (cfg.n_embd, 2 * cfg.n_ff)}

    @staticmethod
    def hparams(m) -> dict:
        n_ctx_train = m.integer("context_length", 2048)
        return {"original_context_length": m.integer("rope.scaling.original_context_length", n_ctx_train),
                "attn_factor": m.number("rope.scaling.attn_factor", 1.0)}

    def configure(self) -> None:
        self.attn_scale = float(F32(1.0) / np.sqrt(F32(self.cfg.head_dim_k)))  # 1.0f / sqrtf(head_dim)

    def _load_block(self, gf, il: int, b):
        cfg = self.cfg
        n_q, n_kv = cfg.n_head * cfg.head_dim_k, cfg.n_head_kv * cfg.head_dim_k
        t = {name: gf.tensor(f"blk.{il}.{name}.weight") for name in self.BLOCK_REQUIRED}
        L = SimpleNamespace(**dict.fromkeys(REQUIRED + OPTIONAL + tuple(n + "_bias" for n in BIASES)))
        for name in ("attn_norm", "attn_output", "ffn_norm", "ffn_down"):
            setattr(L, name, b.weight(t[name]))
        # the fused tensors' rows as tensors of their own: each output row is the same dot product
        L.attn_q, L.attn_k, L.attn_v = (b.weight(t["attn_qkv"].rows(r0, n))
                                        for r0, n in ((0, n_q), (n_q, n_kv), (n_q + n_kv, n_kv)))
        L.ffn_gate, L.ffn_up = (b.weight(t["ffn_up"].rows(r0, cfg.n_ff)) for r0 in (0, cfg.n_ff))
        return L

    def rope_factors(self, gf, n_ctx):
        e = self.cfg.extra
        n_ctx_seq = -(-n_ctx // CTX_PAD) * CTX_PAD if n_ctx else self.cfg.n_ctx_train
        name = "long" if n_ctx_seq > e["original_context_length"] else "short"
        t = gf.tensors.get(f"rope_factors_{name}.weight")
        return (None if t is None else t.as_float32().reshape(-1)), e["attn_factor"]
