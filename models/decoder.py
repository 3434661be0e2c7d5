"""The decoder-only transformer shared by the supported architectures.

An architecture module subclasses `Decoder` and sets its choices (RoPE layout, FFN activation,
embedding scale). Optional tensors (biases, QK-norm, post-norms) are used when the file has them;
the code never asks which quant type or device a weight has: each layer's backend binds the ops.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

F32 = np.float32

# Per-block tensors, named as in GGUF (`blk.N.<name>.weight`); None when absent and optional
# (an architecture's Model may read other sets: BLOCK_REQUIRED / BLOCK_OPTIONAL).
REQUIRED = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL = ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")
BIASES = ("attn_q", "attn_k", "attn_v")
# A prompt's FFN runs FFN_CHUNK tokens at a time, so its two (n_tok, n_ff) buffers hold about
# FFN_CHUNK rows (1.5 MiB for SmolLM2's 512-token batch). Each token must get the float order
# it gets in one call for the whole batch: the products take a batch's tokens four at a time
# (llama.cpp's repacked Q4_K), so chunks start at multiples of 4, and K-quant batches of fewer
# than 8 tokens take the one-token order, so the last chunk is never shorter than 8 (FFN_TAIL_MIN).
FFN_CHUNK = 128
FFN_TAIL_MIN = 8
# A step of up to ALONE_MAX decode tokens (one per sequence) is offered to the backend's fused decode
# block (each token with the one-token kernels and order: the bits it gets decoded alone; the weights
# read once for all of them). The backend may decline some sizes: CPUBackend takes up to 16 tokens
# of a block of legacy types but only 7 of one with K-quants, whose batch products (tiled, 8+ tokens)
# are faster from 8 on (kernels/cpu/fused.py max_tokens).
ALONE_MAX = 16
# Scratch buffer sets kept per backend besides the one-token set: a step of many sequences has
# its batch size and the number of rows that reach the output head.
SCRATCH_SIZES = 3


def ffn_chunks(n: int) -> list[tuple[int, int]]:
    """(start, length) of the FFN chunks of an n-token batch."""
    chunks, i = [], 0
    while i < n:
        m = n - i if n - i < FFN_CHUNK + FFN_TAIL_MIN else FFN_CHUNK
        chunks.append((i, m))
        i += m
    return chunks


class Decoder:
    ROPE_NEOX = False  # RoPE pairs (i, i + n_rot/2) instead of (2i, 2i+1)
    # the RoPE base of sliding-window layers when the file gives none (None: the file's rope.freq_base)
    ROPE_FREQ_BASE_SWA: float | None = None
    SLIDING_WINDOW = 0  # attention.sliding_window when the file has none (0: no window)
    ACTIVATION = "silu"  # gated FFN: act(gate) * up; "silu" or "gelu" (tanh approximation)
    EMBED_SCALE = False  # multiply embeddings by sqrt(n_embd)
    # The attention scale multiplies q (float32, after RoPE) instead of the scores, as llama.cpp's
    # graph does for Gemma: q is rounded to f16 for the K q product after the scaling, so where the
    # scaled value is an f16 subnormal the two orders differ.
    SCALE_Q = False
    PRE_NORM = True  # False: attention and FFN read the residual stream itself (post-norms only)
    QK_NORM_WHOLE = False  # QK-norm over a token's whole q / k projection, not head by head

    # What a file of this architecture carries, for the synthetic-file writer (edgellm.synthetic):
    # per-block tensors beyond llama's as (name suffix, kind: "q_bias" | "kv_bias" | "head_norm" |
    # "embd_norm"), the converter's usual RoPE base and RMS epsilon, the tokenizer's pre-type, and
    # whether key/value lengths are written even when they equal n_embd / n_head, whether the
    # sliding window (and its RoPE base) is, and the architecture's own keys.
    FILE_TENSORS: tuple[tuple[str, str], ...] = ()
    FILE_ROPE_FREQ_BASE = 10000.0
    FILE_RMS_EPS = 1e-5
    FILE_TOKENIZER_PRE = "default"
    FILE_KEY_LENGTH = False
    FILE_SLIDING_WINDOW = False
    FILE_HPARAMS: dict = {}  # `<arch>.<key>` float32 values the architecture's own hparams read

    @staticmethod
    def hparams(m) -> dict:
        """The architecture's own hyperparameters (multipliers, caps), read and checked from the
        file's metadata (`validate.Metadata`) into `cfg.extra`."""
        return {}

    @staticmethod
    def swa_layers(n_layer: int, window: int, metadata) -> tuple[bool, ...]:
        """Per layer: attends within the sliding window (none unless the architecture says so)."""
        return (False,) * n_layer

    # the per-block tensors read (`blk.N.<name>.weight` / `.bias`), checked at load (validate)
    BLOCK_REQUIRED: tuple[str, ...] = REQUIRED
    BLOCK_OPTIONAL: tuple[str, ...] = OPTIONAL
    BLOCK_BIASES: tuple[str, ...] = BIASES

    # required per-block tensors an architecture's own _load_block reads (not as one backend weight)
    BLOCK_OWN: tuple[str, ...] = ()

    @staticmethod
    def block_shapes(cfg) -> dict[str, tuple[int, ...]]:
        """Per-block tensor shapes (GGUF ne) that differ from llama's block (validate.expected_shapes)."""
        return {}

    def __init__(self, cfg, gf, layer_backends, output_backend, embed_backend, n_ctx: int | None = None,
                 expert_backends=None):
        self.cfg = cfg
        # where each block's mixture-of-experts tensors live (default: with the block)
        self.expert_backends = list(expert_backends) if expert_backends else list(layer_backends)
        self.timing = None  # the runtime's StepTiming: a block's share on another device is added there
        self.offloaded = 0.0  # seconds of the blocks' work spent on other devices, taken by the runtime
        self.embed_backend = embed_backend
        self._scratch: dict[tuple[int, int], SimpleNamespace] = {}  # (id(backend), n_tok) -> buffers
        self.output_backend = output_backend
        self.layer_backends = list(layer_backends)
        self.token_embd = embed_backend.weight(gf.tensor("token_embd.weight"))
        self.blocks = [self._load_block(gf, il, b) for il, b in enumerate(self.layer_backends)]
        ob = output_backend
        self.output_norm = ob.weight(gf.tensor("output_norm.weight"))
        head = gf.tensors.get("output.weight") or gf.tensor("token_embd.weight")
        self.output = self.token_embd if (head.name == "token_embd.weight" and ob is embed_backend) else ob.weight(head)
        # multipliers (float32, applied as ggml_scale is: a rounded product), None where there is none
        self.embed_scale = F32(math.sqrt(cfg.n_embd)) if self.EMBED_SCALE else None
        self.residual_scale = None  # on each block's attention and FFN outputs, before the residual add
        self.logit_scale = None  # on the logits
        self.attn_scale = cfg.attn_scale
        self.attn_softcap = None  # Gemma-2's caps: on the attention scores, on the logits
        self.final_softcap = None
        self.configure()
        if self.attn_softcap is not None:
            for b in {id(b): b for b in self.layer_backends}.values():
                b.set_attn_softcap(self.attn_softcap)
        factors, mscale = self.rope_factors(gf, n_ctx)
        if factors is not None or mscale != 1.0:
            if factors is not None and not (np.isfinite(factors).all() and (factors > 0).all()):
                from edgellm.errors import ModelShapeError

                raise ModelShapeError(f"{gf.path}: the RoPE frequency factors must be finite and > 0 (corrupt "
                                      "or hostile file)")
            for b in {id(b): b for b in self.layer_backends}.values():
                b.set_rope_factors(factors, mscale)

    def rope_factors(self, gf, n_ctx: int | None) -> tuple[np.ndarray | None, float]:
        """(float32 (n_rot/2,) divisors of each pair's RoPE angle or None, scale of cos and sin): a
        llama 3 file's rope_freqs by default. n_ctx: a sequence's context (None: not known)."""
        t = gf.tensors.get("rope_freqs.weight")
        return (None if t is None else t.as_float32().reshape(-1)), 1.0

    def configure(self) -> None:
        """An architecture's multipliers from cfg.extra (called at the end of __init__)."""

    @property
    def fused_decode(self) -> bool:
        """The backend's fused decode kernels take llama's pre-norm block (QK-norm per head) without
        a residual multiplier or an attention soft cap."""
        return (self.residual_scale is None and self.attn_softcap is None and self.PRE_NORM
                and not self.QK_NORM_WHOLE)

    def _load_block(self, gf, il: int, b) -> SimpleNamespace:
        w = dict.fromkeys(REQUIRED + OPTIONAL + tuple(name + "_bias" for name in BIASES))
        for name in self.BLOCK_REQUIRED:
            if name not in self.BLOCK_OWN:
                w[name] = b.weight(gf.tensor(f"blk.{il}.{name}.weight"))
        for name in self.BLOCK_OPTIONAL:
            t = gf.tensors.get(f"blk.{il}.{name}.weight")
            w[name] = b.weight(t) if t is not None else None
        for name in self.BLOCK_BIASES:
            t = gf.tensors.get(f"blk.{il}.{name}.bias")
            w[name + "_bias"] = b.weight(t) if t is not None else None
        return SimpleNamespace(**w)

    # --- forward ----------------------------------------------------------------------------
    def embed(self, ids: np.ndarray) -> np.ndarray:
        """float32 (n_tok, n_embd) on the host."""
        x = np.empty((len(ids), self.cfg.n_embd), dtype=np.float32)
        self.embed_backend.embed(self.token_embd, ids, x)
        if self.embed_scale is not None:
            x *= self.embed_scale
        return x

    def rope_params(self, il: int) -> tuple[float, float]:
        cfg = self.cfg
        if cfg.swa_layers[il]:
            return cfg.rope_freq_base_swa, 1.0
        return cfg.rope_freq_base, cfg.rope_freq_scale

    def scratch(self, b, n: int) -> SimpleNamespace:
        """Activation buffers of a block of n tokens on backend b, allocated once and reused by every
        layer on b (kept for n = 1 and the SCRATCH_SIZES latest other sizes)."""
        key = (id(b), n)
        s = self._scratch.pop(key, None)
        if s is None:
            kept = [k for k in self._scratch if k[0] == id(b) and k[1] != 1]
            for old in kept[:max(0, len(kept) - SCRATCH_SIZES + 1)]:  # the least recently used go
                del self._scratch[old]
            cfg = self.cfg
            shapes = dict(h=cfg.n_embd, q=cfg.n_head * cfg.head_dim_k, k=cfg.n_head_kv * cfg.head_dim_k,
                          v=cfg.n_head_kv * cfg.head_dim_v, a=cfg.n_head * cfg.head_dim_v, o=cfg.n_embd)
            s = self._scratch[key] = SimpleNamespace(**{name: b.empty((n, m)) for name, m in shapes.items()})
            rows = max(m for _, m in ffn_chunks(n))
            s.gate, s.up = (b.empty((rows, cfg.n_ff)) for _ in range(2))
        self._scratch[key] = s  # most recently used last
        return s

    def decode_all(self, x, pos: np.ndarray, kvs, layers=None) -> bool:
        """Every block (or the blocks `layers`, with caches kvs) for n decode tokens (one per
        sequence, each attending alone) in one call of the layers' backend (`decode_layers`), x
        (n, n_embd) updated in place: the same bits as `block` layer by layer. False, having done
        nothing, when the layers are not all on one backend that offers it, or it declines (a type
        or cache without the fused kernels)."""
        if layers is None:
            blocks, backends, ropes = self.blocks, self.layer_backends, self.__dict__.get("_ropes")
            if ropes is None:
                ropes = self._ropes = [self.rope_params(il) for il in range(len(self.blocks))]
        else:
            blocks, backends = [self.blocks[il] for il in layers], [self.layer_backends[il] for il in layers]
            ropes = [self.rope_params(il) for il in layers]
        b = backends[0] if backends else None
        decode_layers = getattr(b, "decode_layers", None)
        n = x.shape[0]
        lay = getattr(kvs[0], "layout", None) if kvs else None
        if (decode_layers is None or not self.fused_decode or any(lb is not b for lb in backends)
                or not (n == 1 or (n <= ALONE_MAX and getattr(lay, "n_single", 0) == n))):
            return False
        cfg = self.cfg
        q_scale, att_scale = (self.attn_scale, 1.0) if self.SCALE_Q else (1.0, self.attn_scale)
        return decode_layers(blocks, x, pos, kvs, self.scratch(b, n), ropes=ropes, eps=cfg.rms_eps,
                             n_rot=cfg.n_rot, neox=self.ROPE_NEOX, scale=att_scale,
                             gelu=self.ACTIVATION == "gelu", q_scale=q_scale)

    def block(self, il: int, b, x, pos: np.ndarray, kv, rows=None):
        """One transformer block on backend b, x (n_tok, n_embd) updated in place; returns x, or
        with `rows` the rows that went on.

        rows: after attention only these rows of x go on (the last layer of a batch whose other
        positions need no logits: llama.cpp's output-row selection, which also decides which
        product kernels, so which float order, the FFN runs with): None for all, a slice (the last
        row: `slice(n - 1, n)`) or an index array. The block then returns those rows of x (a view
        for a slice, a new array for indices), updated.

        The backend's fused ops (edgellm.backend.Backend: `linear_many` (products sharing an input),
        `qkv_attention` (biases, QK-norm, RoPE, cache store, attention), `add_rms_norm` (post-norm,
        residual, next norm)) run as the primitive ops unless the backend fuses them (CPUBackend)."""
        cfg, L = self.cfg, self.blocks[il]
        n = x.shape[0]
        hd_k, hd_v, eps = cfg.head_dim_k, cfg.head_dim_v, cfg.rms_eps
        s = self.scratch(b, n)
        base, scale = self.rope_params(il)
        q_scale, att_scale = (self.attn_scale, 1.0) if self.SCALE_Q else (1.0, self.attn_scale)
        decode_block = getattr(b, "decode_block", None) if self.fused_decode else None
        lay = getattr(kv, "layout", None)
        if (decode_block is not None and (n == 1 or (n <= ALONE_MAX and getattr(lay, "n_single", 0) == n))
                and decode_block(L, x, pos, kv, s, eps=eps, n_rot=cfg.n_rot, freq_base=base, freq_scale=scale,
                                 neox=self.ROPE_NEOX, scale=att_scale, gelu=self.ACTIVATION == "gelu",
                                 q_scale=q_scale)):
            # the backend ran the whole block in one fused call: decode tokens, one per sequence,
            # each with the bits it gets alone
            return x if rows is None else x[rows]
        add_rms_norm, qkv_attention, linear_many = b.add_rms_norm, b.qkv_attention, b.linear_many

        # attention rmsnorm (a post-norm block's attention reads the residual stream)
        if self.PRE_NORM:
            b.rms_norm(x, L.attn_norm, eps, s.h)
        else:
            s.h[...] = x
        # q, k, v projections
        linear_many((L.attn_q, L.attn_k, L.attn_v), s.h, (s.q, s.k, s.v))
        q_norm, k_norm = L.attn_q_norm, L.attn_k_norm
        if self.QK_NORM_WHOLE:  # one RMS over all of a token's heads
            b.rms_norm(s.q, q_norm, eps, s.q)
            b.rms_norm(s.k, k_norm, eps, s.k)
            q_norm = k_norm = None
        # (+ bias, per-head QK-norm, rotary position embedding), into the cache, attention over it
        qkv_attention(s.q.reshape(n, cfg.n_head, hd_k), s.k.reshape(n, cfg.n_head_kv, hd_k),
                      s.v.reshape(n, cfg.n_head_kv, hd_v),
                      biases=(L.attn_q_bias, L.attn_k_bias, L.attn_v_bias), q_norm=q_norm,
                      k_norm=k_norm, eps=eps, n_rot=cfg.n_rot, freq_base=base, freq_scale=scale,
                      neox=self.ROPE_NEOX, kv=kv, pos=pos, scale=att_scale, out=s.a, q_scale=q_scale)
        # output projection, (post-norm,) residual connection back into x, ffn rmsnorm
        b.linear(L.attn_output, s.a, s.o)
        o = s.o
        if rows is not None:
            x, o = x[rows], o[rows]
            if x.shape[0] == 0:  # no row goes on (a prompt chunk that is not a prompt's end)
                return x
            if x.shape[0] != n:
                s = self.scratch(b, x.shape[0])
        if self.residual_scale is not None:
            o *= self.residual_scale
        add_rms_norm(x, o, L.post_attention_norm, L.ffn_norm, eps, s.h)
        if not self.PRE_NORM:  # the FFN reads the residual stream
            s.h[...] = x
        self.ffn(b, L, s, x.shape[0])
        # (post-norm,) residual connection
        if self.residual_scale is not None:
            s.o *= self.residual_scale
        add_rms_norm(x, s.o, L.post_ffw_norm, None, eps, None)
        return x

    def ffn(self, b, L, s, n: int) -> None:
        """s.o[:n] = the block's FFN of s.h[:n]: the gated FFN, FFN_CHUNK tokens at a time."""
        act = b.gelu_mul if self.ACTIVATION == "gelu" else b.silu_mul
        for i, m in ffn_chunks(n):
            gate, up = s.gate[:m], s.up[:m]
            b.linear_many((L.ffn_gate, L.ffn_up), s.h[i:i + m], (gate, up))
            act(gate, up, gate)
            b.linear(L.ffn_down, gate, s.o[i:i + m])

    def head(self, x) -> np.ndarray:
        """Final norm and output head on the output backend; x (n, n_embd) on that backend.
        Returns host float32 (n, n_vocab), a new array."""
        b = self.output_backend
        h = self.scratch(b, x.shape[0]).h
        b.rms_norm(x, self.output_norm, self.cfg.rms_eps, h)
        logits = b.empty((x.shape[0], self.cfg.n_vocab))
        b.linear(self.output, h, logits)
        if self.logit_scale is not None:
            logits *= self.logit_scale
        logits = b.to_host(logits)
        if self.final_softcap is not None:  # cap * tanh(logits / cap) (on the host: the C library's tanhf)
            from edgellm.kernels import cpu

            cpu._import("ops").soft_cap(logits.reshape(-1), self.final_softcap)
        return logits

