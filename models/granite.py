"""granite (IBM Granite 3.x dense): the llama block with four multipliers from the file — the
embeddings times embedding_scale, the attention scores times attention.scale (1/sqrt(head_dim)
when 0 or absent), each block's attention and FFN outputs times residual_scale before their
residual add, the logits times 1/logit_scale — each a float32 product, as ggml_scale makes it."""
import math

import numpy as np

from edgellm.models.decoder import Decoder

F32 = np.float32


class Model(Decoder):
    ROPE_NEOX = False
    ACTIVATION = "silu"
    # Granite-3.3-2B's multipliers
    FILE_HPARAMS = {"logit_scale": 8.0, "residual_scale": 0.22, "embedding_scale": 12.0, "attention.scale": 0.015625}

    @staticmethod
    def hparams(m) -> dict:
        # logit_scale is required (llama.cpp refuses a file without it); the rest optional, 0 = none
        return {"logit_scale": m.number("logit_scale"),
                "residual_scale": m.number("residual_scale", 0.0, lo=-math.inf) or None,
                "embedding_scale": m.number("embedding_scale", 0.0, lo=-math.inf) or None,
                "attention_scale": m.number("attention.scale", 0.0, lo=-math.inf) or None}

    def configure(self) -> None:
        e = self.cfg.extra
        self.logit_scale = F32(1.0) / F32(e["logit_scale"])
        if e["residual_scale"] is not None:
            self.residual_scale = F32(e["residual_scale"])
        if e["embedding_scale"] is not None:
            self.embed_scale = F32(e["embedding_scale"])
        if e["attention_scale"] is not None:
            self.attn_scale = float(F32(e["attention_scale"]))
