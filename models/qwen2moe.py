"""qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): qwen2's attention block (Q, K, V biases) with
qwen3moe's experts, their probabilities not renormalised, and a shared expert every token takes:
a dense SwiGLU FFN whose output is scaled by sigmoid(x . ffn_gate_inp_shexp), computed as llama.cpp
does, silu(g) / g, and added to the experts' sum."""
from __future__ import annotations

from types import SimpleNamespace
from typing import ClassVar

import numpy as np
from edgellm.models import qwen2, qwen3moe
from edgellm.models.decoder import Decoder, ffn_chunks

F32 = np.float32
SHARED = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


class Model(qwen3moe.Model):
    BLOCK_REQUIRED = qwen3moe.Model.BLOCK_REQUIRED + SHARED
    BLOCK_OWN = (*qwen3moe.MOE, "ffn_gate_inp_shexp")
    NORM_TOPK = False
    CPU_ONLY = True  # the shared expert's FFN runs on host buffers: its layers stay on the CPU
    FILE_TENSORS = qwen2.Model.FILE_TENSORS
    FILE_KEY_LENGTH = False
    FILE_TOKENIZER_PRE = "qwen2"
    FILE_HPARAMS: ClassVar[dict] = {**qwen3moe.Model.FILE_HPARAMS, "expert_shared_feed_forward_length": 128}

    @staticmethod
    def hparams(m) -> dict:
        # the shared expert's width; 0 or absent: feed_forward_length (resolved in block_shapes)
        return {**qwen3moe.Model.hparams(m),
                "n_ff_shexp": m.integer("expert_shared_feed_forward_length", 0, lo=0)}

    @staticmethod
    def block_shapes(cfg) -> dict[str, tuple[int, ...]]:
        d, ffs = cfg.n_embd, cfg.extra["n_ff_shexp"] or cfg.n_ff
        return {**qwen3moe.Model.block_shapes(cfg), "ffn_gate_inp_shexp": (d,), "ffn_gate_shexp": (d, ffs),
                "ffn_up_shexp": (d, ffs), "ffn_down_shexp": (ffs, d)}

    def _load_block(self, gf, il: int, b):
        L = super()._load_block(gf, il, b)
        gate = gf.tensor(f"blk.{il}.ffn_gate_inp_shexp.weight")
        L.ffn_gate_inp_shexp = np.array(gate.as_float32().reshape(1, -1), dtype=F32, copy=True)  # one F32 row
        return L

    def ffn(self, b, L, s, n: int) -> None:
        super().ffn(b, L, s, n)  # the experts' sum into s.o[:n]
        experts = s.o[:n].copy()
        # the shared expert: the dense FFN (its batch orders) into s.o[:n], on buffers of its width
        ffs = self.cfg.extra["n_ff_shexp"] or self.cfg.n_ff
        rows = max(m for _, m in ffn_chunks(n))
        shared = SimpleNamespace(h=s.h, o=s.o, gate=np.empty((rows, ffs), F32), up=np.empty((rows, ffs), F32))
        Decoder.ffn(self, b, SimpleNamespace(ffn_gate=L.ffn_gate_shexp, ffn_up=L.ffn_up_shexp,
                                             ffn_down=L.ffn_down_shexp), shared, n)
        g = np.empty((n, 1), F32)
        self.moe.router_logits(L.ffn_gate_inp_shexp, s.h[:n], g)
        s.o[:n] *= self.moe.silu_scalar(g) / g
        s.o[:n] += experts
