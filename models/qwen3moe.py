"""qwen3moe (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): qwen3's attention block with a mixture-of-experts
FFN. A router (F32, n_expert rows) scores the experts; the softmax's k best are chosen and their
probabilities renormalised; each chosen expert is a SwiGLU FFN of n_ff_exp rows; their outputs,
times their weights, are summed in the order chosen (most probable first), as llama.cpp does.

Expert products take llama.cpp's MUL_MAT_ID orders: every routed (token, slot) row alone with the
one-token kernels, except the K-quant types llama.cpp does not repack (Q2_K, Q3_K, Q5_K, Q6_K, and
Q4_K with rows not a multiple of 8), whose rows routed to one expert go together (the batch order
from 8 rows on).

The experts may live on another device than the rest of the block (-ot, --cpu-moe, --n-cpu-moe):
the normed hidden rows cross to the host, the router and routing run there (the router is a host
array), the experts run on their backend, and their weighted sum crosses back. Experts on the GPU
take the routed rows gathered on the host, one product per used expert.
"""
from __future__ import annotations

import time
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
        L = super()._load_block(gf, il, b)
        router = gf.tensor(f"blk.{il}.ffn_gate_inp.weight")
        if router.qtype.name != "F32":
            from edgellm.errors import ModelShapeError

            raise ModelShapeError(f"{gf.path}: blk.{il}.ffn_gate_inp.weight is {router.qtype.name}; a router is F32")
        L.ffn_gate_inp = np.array(router.as_float32(), dtype=F32, copy=True)  # (n_expert, n_embd)
        eb = L.expert_backend = self.expert_backends[il]
        for name in EXPERTS:
            t = gf.tensor(f"blk.{il}.{name}.weight")
            setattr(L, name, [eb.weight(t.expert(e)) for e in range(t.ne[2])])
            if hasattr(eb, "bind_experts"):  # all of a tensor's experts in one packed array (decode's kernels)
                eb.bind_experts(getattr(L, name))
        return L

    def configure(self) -> None:
        from edgellm.kernels import cpu

        super().configure()
        self.moe = cpu._import("moe")  # the routing kernels (looked up once, not per layer and token)

    def ffn(self, b, L, s, n: int) -> None:
        eb = L.expert_backend
        if eb is b and b.device == "cpu":
            self.experts_cpu(b, L, s.h[:n], s.o[:n])
            return
        # the block and its experts apart (or experts on the GPU): the rows to the host and back
        t0 = time.perf_counter()
        h = b.to_host(s.h[:n])
        out = np.empty((n, self.cfg.n_embd), F32)
        t1 = time.perf_counter()
        (self.experts_cpu if eb.device == "cpu" else self.experts_device)(eb, L, h, out)
        t2 = time.perf_counter()
        s.o[:n] = b.from_host(out)
        b.synchronize()
        t3 = time.perf_counter()
        self.timing.add(eb.device, t2 - t1)
        self.timing.add("transfer", (t1 - t0) + (t3 - t2))
        self.timing.crossings += 2
        self.offloaded += t3 - t0

    def route(self, L, h: np.ndarray):
        """(ids (n, k), weights (n, k)) of host rows h: the router's scores, the k best experts."""
        logits = np.empty((h.shape[0], len(L.ffn_gate_inp)), F32)
        self.moe.router_logits(L.ffn_gate_inp, h, logits)
        return self.moe.route_logits(logits, self.cfg.extra["n_expert_used"], self.NORM_TOPK)

    def experts_device(self, eb, L, h: np.ndarray, acc: np.ndarray) -> None:
        """acc (n, n_embd, host) = the chosen experts' weighted sum for host rows h, the experts'
        products on device backend eb: each used expert's rows gathered on the host, one copy in and
        one out per expert."""
        cfg = self.cfg
        n, ff = h.shape[0], cfg.extra["n_ff_exp"]
        ids, weights = self.route(L, h)
        out = np.empty((n, ids.shape[1], cfg.n_embd), F32)
        for e in np.unique(ids):
            tok, slot = np.nonzero(ids == e)
            xe = eb.from_host(np.ascontiguousarray(h[tok]))
            gate, up, down = eb.empty((len(tok), ff)), eb.empty((len(tok), ff)), eb.empty((len(tok), cfg.n_embd))
            eb.linear_many((L.ffn_gate_exps[e], L.ffn_up_exps[e]), xe, (gate, up))
            eb.silu_mul(gate, up, gate)
            eb.linear(L.ffn_down_exps[e], gate, down)
            out[tok, slot] = eb.to_host(down)
        _weighted_sum(out, weights, acc)

    def experts_cpu(self, b, L, h: np.ndarray, acc: np.ndarray) -> None:
        """acc (n, n_embd) = the chosen experts' weighted sum for rows h, on the CPU backend b."""
        n = h.shape[0]
        cfg = self.cfg
        k, ff = cfg.extra["n_expert_used"], cfg.extra["n_ff_exp"]
        ids, weights = self.route(L, h)
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
        _weighted_sum(out, weights, acc)


def _weighted_sum(out: np.ndarray, weights: np.ndarray, acc: np.ndarray) -> None:
    """acc = sum over slots j of out[:, j] * weights[:, j]: float32 adds in slot order."""
    out *= weights[:, :, None]
    acc[...] = out[:, 0]
    for j in range(1, out.shape[1]):
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
