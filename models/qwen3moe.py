"""qwen3moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): qwen3's attention block with a mixture-of-experts
FFN. A router (F32, n_expert rows) scores the experts; the softmax's k best are chosen and their
probabilities renormalised; each chosen expert is a SwiGLU FFN of n_ff_exp rows; their outputs,
times their weights, are summed in the order chosen (most probable first), as llama.cpp does.

Expert products take llama.cpp's MUL_MAT_ID orders: every routed (token, slot) row alone with the
one-token kernels, except the K-quant types llama.cpp does not repack (Q2_K, Q3_K, Q5_K, Q6_K, and
Q4_K with rows not a multiple of 8), whose rows routed to one expert go together (the batch order
from 8 rows on). Runs on the CPU backend.
"""
from __future__ import annotations

from typing import ClassVar

import numpy as np
from edgellm.models import qwen3
from edgellm.models.decoder import REQUIRED
from gguf import GGMLQuantizationType

F32 = np.float32
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MOE = ("ffn_gate_inp",) + EXPERTS
_GROUPED = {"Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS"}  # llama.cpp's tiled MUL_MAT_ID types (not repacked)


class Model(qwen3.Model):
    BLOCK_REQUIRED = tuple(n for n in REQUIRED if n not in ("ffn_gate", "ffn_up", "ffn_down")) + MOE
    BLOCK_OWN = MOE
    NORM_TOPK = True  # qwen3moe renormalises the chosen probabilities (hard-coded in llama.cpp)
    # a small file's experts (synthetic files; real ones carry theirs)
    FILE_HPARAMS: ClassVar[dict] = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64}
    fused_decode = False  # the fused decode block is a dense FFN's

    @staticmethod
    def hparams(m) -> dict:
        n_expert = m.integer("expert_count")
        return {"n_expert": n_expert,
                "n_expert_used": m.integer("expert_used_count", hi=n_expert),
                "n_ff_exp": m.integer("expert_feed_forward_length")}

    @staticmethod
    def block_shapes(cfg) -> dict[str, tuple[int, ...]]:
        e, d = cfg.extra, cfg.n_embd
        n, ff = e["n_expert"], e["n_ff_exp"]
        return {"ffn_gate_inp": (d, n), "ffn_gate_exps": (d, ff, n), "ffn_up_exps": (d, ff, n),
                "ffn_down_exps": (ff, d, n)}

    def _load_block(self, gf, il: int, b):
        if b.device != "cpu":
            from edgellm.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(
                f"{gf.path}: a mixture-of-experts layer runs on the CPU only, for now: use --gpu-layers 0")
        L = super()._load_block(gf, il, b)
        router = gf.tensor(f"blk.{il}.ffn_gate_inp.weight")
        if router.qtype.name != "F32":
            from edgellm.errors import ModelShapeError

            raise ModelShapeError(f"{gf.path}: blk.{il}.ffn_gate_inp.weight is {router.qtype.name}; a router is F32")
        L.ffn_gate_inp = np.array(router.as_float32(), dtype=F32, copy=True)  # (n_expert, n_embd)
        for name in EXPERTS:
            t = gf.tensor(f"blk.{il}.{name}.weight")
            setattr(L, name, [b.weight(t.expert(e)) for e in range(t.ne[2])])
            if hasattr(b, "bind_experts"):  # all of a tensor's experts in one packed array (decode's kernels)
                b.bind_experts(getattr(L, name))
        return L

    def configure(self) -> None:
        from edgellm.kernels import cpu

        super().configure()
        self.moe = cpu._import("moe")  # the routing kernels (looked up once, not per layer and token)

    def ffn(self, b, L, s, n: int) -> None:
        moe = self.moe
        h = s.h[:n]
        cfg = self.cfg
        k, ff = cfg.extra["n_expert_used"], cfg.extra["n_ff_exp"]
        logits = np.empty((n, len(L.ffn_gate_inp)), F32)
        moe.router_logits(L.ffn_gate_inp, h, logits)
        ids, weights = moe.route_logits(logits, k, self.NORM_TOPK)
        out = np.empty((n, k, cfg.n_embd), F32)
        if n == 1:  # decode: the backend's fused expert kernels, or the chosen experts' products in turn
            if not b.moe_decode((L.ffn_gate_exps, L.ffn_up_exps, L.ffn_down_exps), ids[0], h, out[0]):
                gate, up = np.empty((k, 1, ff), F32), np.empty((k, 1, ff), F32)
                chosen = ids[0].tolist()
                b.linear_many([L.ffn_gate_exps[e] for e in chosen] + [L.ffn_up_exps[e] for e in chosen], h,
                              list(gate) + list(up))
                b.silu_mul(gate.reshape(k, ff), up.reshape(k, ff), gate.reshape(k, ff))
                for j, e in enumerate(chosen):
                    b.linear(L.ffn_down_exps[e], gate[j], out[0, j:j + 1])
        else:
            for e in np.unique(ids):
                tok, slot = np.nonzero(ids == e)  # the rows routed to e: token order, then slot order
                xe = np.ascontiguousarray(h[tok])
                gate, up = np.empty((len(tok), ff), F32), np.empty((len(tok), ff), F32)
                _products(b, (L.ffn_gate_exps[e], L.ffn_up_exps[e]), xe, (gate, up))
                b.silu_mul(gate, up, gate)
                down = np.empty((len(tok), cfg.n_embd), F32)
                _products(b, (L.ffn_down_exps[e],), gate, (down,))
                out[tok, slot] = down
        out *= weights[:, :, None]
        acc = s.o[:n]
        acc[...] = out[:, 0]
        for j in range(1, k):  # float32 adds in slot order
            acc += out[:, j]


def _products(b, ws, x: np.ndarray, outs) -> None:
    """outs[i] = x @ ws[i].T with llama.cpp's MUL_MAT_ID order for each matrix's type (see the
    module's docstring): all rows together, or row by row (one-token order)."""
    together = [_grouped(w) for w in ws]
    if all(together):
        b.linear_many(ws, x, outs)
        return
    for w, o, g in zip(ws, outs, together):
        if g:
            b.linear(w, x, o)
    alone = [(w, o) for w, o, g in zip(ws, outs, together) if not g]
    b.linear_rows([w for w, _ in alone], x, [o for _, o in alone])


def _grouped(w) -> bool:
    name = GGMLQuantizationType(w.ggml_type).name
    return name in _GROUPED or (name == "Q4_K" and w.n_rows % 8 != 0)
