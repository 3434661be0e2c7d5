"""The decoder-only transformer shared by the supported architectures.

An architecture module subclasses `Decoder` and sets its choices (RoPE layout, FFN activation,
embedding scale). Optional tensors (biases, QK-norm, post-norms) are used when the file has them;
the code never asks which quant type or device a weight has: each layer's backend binds the ops.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

# Per-block tensors, named as in GGUF (`blk.N.<name>.weight`); None when absent and optional.
REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL = ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")
BIASES = ("attn_q", "attn_k", "attn_v")


class Decoder:
    ROPE_NEOX = False  # RoPE pairs (i, i + n_rot/2) instead of (2i, 2i+1)
    ACTIVATION = "silu"  # gated FFN: act(gate) * up; "silu" or "gelu" (tanh approximation)
    EMBED_SCALE = False  # multiply embeddings by sqrt(n_embd)

    def __init__(self, cfg, gf, layer_backends, output_backend, embed_backend):
        self.cfg = cfg
        self.embed_backend = embed_backend
        self.output_backend = output_backend
        self.layer_backends = list(layer_backends)
        self.token_embd = embed_backend.weight(gf.tensor("token_embd.weight"))
        self.blocks = [self._load_block(gf, il, b) for il, b in enumerate(self.layer_backends)]
        ob = output_backend
        self.output_norm = ob.weight(gf.tensor("output_norm.weight"))
        head = gf.tensors.get("output.weight") or gf.tensor("token_embd.weight")
        self.output = self.token_embd if (head.name == "token_embd.weight" and ob is embed_backend) else ob.weight(head)

    def _load_block(self, gf, il: int, b) -> SimpleNamespace:
        w = {}
        for name in REQUIRED:
            w[name] = b.weight(gf.tensor(f"blk.{il}.{name}.weight"))
        for name in OPTIONAL:
            t = gf.tensors.get(f"blk.{il}.{name}.weight")
            w[name] = b.weight(t) if t is not None else None
        for name in BIASES:
            t = gf.tensors.get(f"blk.{il}.{name}.bias")
            w[name + "_bias"] = b.weight(t) if t is not None else None
        return SimpleNamespace(**w)

    # --- forward ----------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        """float32 (n_tok, n_embd) on the host."""
        x = np.empty((len(ids), self.cfg.n_embd), dtype=np.float32)
        self.embed_backend.embed(self.token_embd, ids, x)
        if self.EMBED_SCALE:
            x *= np.float32(math.sqrt(self.cfg.n_embd))
        return x

    def rope_params(self, il: int) -> tuple[float, float]:
        cfg = self.cfg
        if cfg.swa_layers[il]:
            return cfg.rope_freq_base_swa, 1.0
        return cfg.rope_freq_base, cfg.rope_freq_scale

    def block(self, il: int, b, x, pos: np.ndarray, kv) -> None:
        """One transformer block on backend b, x (n_tok, n_embd) updated in place."""
        cfg, L = self.cfg, self.blocks[il]
        n = x.shape[0]
        hd_k, hd_v, eps = cfg.head_dim_k, cfg.head_dim_v, cfg.rms_eps

        # attention rmsnorm
        h = b.empty((n, cfg.n_embd))
        b.rms_norm(x, L.attn_norm, eps, h)
        # q, k, v projections (+ bias)
        q = b.empty((n, cfg.n_head * hd_k))
        k = b.empty((n, cfg.n_head_kv * hd_k))
        v = b.empty((n, cfg.n_head_kv * hd_v))
        for w, bias, out in ((L.attn_q, L.attn_q_bias, q), (L.attn_k, L.attn_k_bias, k), (L.attn_v, L.attn_v_bias, v)):
            b.linear(w, h, out)
            if bias is not None:
                b.add(out, bias, out)
        q3 = q.reshape(n, cfg.n_head, hd_k)
        k3 = k.reshape(n, cfg.n_head_kv, hd_k)
        v3 = v.reshape(n, cfg.n_head_kv, hd_v)
        # per-head QK-norm
        if L.attn_q_norm is not None:
            b.rms_norm(q3, L.attn_q_norm, eps, q3)
        if L.attn_k_norm is not None:
            b.rms_norm(k3, L.attn_k_norm, eps, k3)
        # rotary position embedding, then into the cache
        base, scale = self.rope_params(il)
        b.rope(q3, pos, cfg.n_rot, base, scale, self.ROPE_NEOX)
        b.rope(k3, pos, cfg.n_rot, base, scale, self.ROPE_NEOX)
        b.kv_store(kv, k3, v3, pos)
        # attention over the cache, output projection
        a = b.empty((n, cfg.n_head * hd_v))
        b.attention(q3, kv, pos, cfg.attn_scale, a)
        o = b.empty((n, cfg.n_embd))
        b.linear(L.attn_output, a, o)
        if L.post_attention_norm is not None:
            b.rms_norm(o, L.post_attention_norm, eps, o)
        # residual connection back into x
        b.add(x, o, x)

        # ffn rmsnorm, gated FFN
        b.rms_norm(x, L.ffn_norm, eps, h)
        gate = b.empty((n, cfg.n_ff))
        up = b.empty((n, cfg.n_ff))
        b.linear(L.ffn_gate, h, gate)
        b.linear(L.ffn_up, h, up)
        if self.ACTIVATION == "gelu":
            b.gelu_mul(gate, up, gate)
        else:
            b.silu_mul(gate, up, gate)
        b.linear(L.ffn_down, gate, o)
        if L.post_ffw_norm is not None:
            b.rms_norm(o, L.post_ffw_norm, eps, o)
        # residual connection
        b.add(x, o, x)

    def head(self, x) -> np.ndarray:
        """Final norm and output head on the output backend; x (n, n_embd) on that backend.
        Returns host float32 (n, n_vocab)."""
        b = self.output_backend
        h = b.empty(x.shape)
        b.rms_norm(x, self.output_norm, self.cfg.rms_eps, h)
        logits = b.empty((x.shape[0], self.cfg.n_vocab))
        b.linear(self.output, h, logits)
        return b.to_host(logits)
