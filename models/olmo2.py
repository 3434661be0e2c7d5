"""olmo2 (OLMo 2): post-norms only — attention and the FFN read the residual stream, their outputs
are RMS-normed before each residual add — and QK-norm over a token's whole q / k projection (one
RMS across heads) before neox RoPE."""
from edgellm.models.decoder import Decoder


class Model(Decoder):
    ROPE_NEOX = True
    ACTIVATION = "silu"
    PRE_NORM = False
    QK_NORM_WHOLE = True
    BLOCK_REQUIRED = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
                      "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    BLOCK_OPTIONAL = ()
    BLOCK_BIASES = ()
    FILE_TENSORS = (("attn_q_norm.weight", "q_norm_whole"), ("attn_k_norm.weight", "kv_norm_whole"),
                    ("post_attention_norm.weight", "embd_norm"), ("post_ffw_norm.weight", "embd_norm"))
    FILE_ROPE_FREQ_BASE = 500000.0
    FILE_RMS_EPS = 1e-6

    @staticmethod
    def block_shapes(cfg) -> dict[str, tuple[int, ...]]:
        return {"attn_q_norm": (cfg.n_head * cfg.head_dim_k,), "attn_k_norm": (cfg.n_head_kv * cfg.head_dim_k,)}
