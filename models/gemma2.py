"""gemma2: gemma3's block without QK-norm (embeddings times sqrt(n_embd), RMSNorm weights as
stored, norms after attention and after the FFN, GELU-tanh gated FFN, neox RoPE, q scaled after
RoPE) with Gemma-2's soft caps — each raw attention score becomes cap * tanh(score / cap)
(attn_logit_softcapping, 50 by default) and so do the logits (final_logit_softcapping, 30) — and
every other layer (il % 2 == 0) attending within the sliding window (4096 by default), at the
file's one RoPE base. The q scale is 1/sqrt(head_dim), or 1/sqrt(n_embd / n_head) for the 27B
(46 layers), as llama.cpp chooses it."""
import numpy as np

from edgellm.models.decoder import Decoder

F32 = np.float32
SWA_PERIOD = 2
N_LAYER_27B = 46


class Model(Decoder):
    ROPE_NEOX = True
    SLIDING_WINDOW = 4096  # llama.cpp's gemma2 default
    ACTIVATION = "gelu"
    EMBED_SCALE = True
    SCALE_Q = True
    BLOCK_REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "post_attention_norm", "ffn_norm",
                      "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    BLOCK_OPTIONAL = ()
    BLOCK_BIASES = ()
    FILE_TENSORS = (("post_attention_norm.weight", "embd_norm"), ("post_ffw_norm.weight", "embd_norm"))
    FILE_RMS_EPS = 1e-6
    FILE_SLIDING_WINDOW = True
    FILE_HPARAMS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}

    @staticmethod
    def hparams(m) -> dict:
        return {"attn_softcap": m.number("attn_logit_softcapping", 50.0),
                "final_softcap": m.number("final_logit_softcapping", 30.0)}

    @staticmethod
    def swa_layers(n_layer: int, window: int, metadata) -> tuple[bool, ...]:
        if window <= 0:
            return (False,) * n_layer
        return tuple(il % SWA_PERIOD < SWA_PERIOD - 1 for il in range(n_layer))

    def configure(self) -> None:
        cfg, e = self.cfg, self.cfg.extra
        width = cfg.n_embd // cfg.n_head if cfg.n_layer == N_LAYER_27B else cfg.head_dim_k
        self.attn_scale = float(F32(1.0) / np.sqrt(F32(width)))  # 1.0f / sqrtf(width)
        self.attn_softcap = F32(e["attn_softcap"])
        self.final_softcap = F32(e["final_softcap"])
