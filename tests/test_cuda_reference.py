"""NumPy twins of the CUDA kernels, and the checks that hold them to the CPU backend and to the math.

The functions at the top are deliberately plain (loops, float64) and are what scripts/checks/gpu_check.py
compares every CUDA kernel against on a GPU machine; this module imports neither pytest nor CuPy so
that script can import it. Dequantization's twin is gguf.quants.dequantize (QuantType.dequantize_reference).
"""
from __future__ import annotations

import math

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.quants import QUANT_TYPES
from quant_blocks import F16_FIELDS, set_iq1_m_d

# ============================================================================ references


def dequantize_ref(ggml_type, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """uint8 (n_rows, row_bytes) -> float32 (n_rows, n_cols), by gguf's NumPy dequantizer."""
    return QUANT_TYPES[GGMLType(ggml_type)].dequantize_reference(raw).reshape(raw.shape[0], n_cols)


def linear_ref(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """out (n_tok, n_rows) = x (n_tok, n_cols) @ W.T, in float64."""
    return (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)


# 8-bit activations (quant_act.cu and the matvec_q8_* kernels): the CPU backend's formats, float32 steps
Q8_1_WEIGHTS = (GGMLType.Q4_1, GGMLType.Q5_1)


def act_format(ggml_type) -> str:
    """The 8-bit activation format of a quantized weight type: "q8_32" (legacy) or "q8_k" (K-quants)."""
    return "q8_32" if QUANT_TYPES[GGMLType(ggml_type)].block_size == 32 else "q8_k"


def quantize_q8_32_ref(x: np.ndarray):
    """x float32 (n,) -> xq int8 (n,), xd float32 (n/32,) = fp16(amax / 127), xs int32 = sum(q),
    xm float32 = fp16(d * sum(q)) with the unrounded d; q = round-half-even(x * (127 / amax))."""
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    inv = np.zeros_like(amax)
    np.divide(np.float32(127), amax, out=inv, where=amax > 0)
    q = np.rint(xb * inv[:, None]).astype(np.int32)
    s = q.sum(axis=-1, dtype=np.int32)
    xm = (d * s.astype(np.float32)).astype(np.float16).astype(np.float32)
    return q.astype(np.int8).reshape(-1), d.astype(np.float16).astype(np.float32), s, xm


def quantize_q8_k_ref(x: np.ndarray):
    """x float32 (n,) -> xq int8 (n,), xd float32 (n/256,), xs int32 (n/16,): v = the first value of
    largest magnitude of a block, iscale = -127 / v, q = min(127, round-half-even(iscale * x)),
    xd = 1 / iscale, xs = sums of q per 16 (all 0 for a block of zeros)."""
    xb = x.reshape(-1, 256).astype(np.float32)
    vmax = xb[np.arange(len(xb)), np.abs(xb).argmax(axis=-1)]  # argmax: the first of equal maxima
    iscale = np.zeros_like(vmax)
    np.divide(np.float32(-127), vmax, out=iscale, where=vmax != 0)
    d = np.zeros_like(vmax)
    np.divide(np.float32(1), iscale, out=d, where=iscale != 0)
    q = np.minimum(np.rint(iscale[:, None] * xb), 127).astype(np.int32)
    return q.astype(np.int8).reshape(-1), d, q.reshape(-1, 16).sum(axis=-1, dtype=np.int32)


def requantized_ref(fmt: str, x: np.ndarray) -> np.ndarray:
    """x (n_tok, n) through 8 bits and back: d * q in float32 (what a prompt product multiplies)."""
    if fmt == "q8_32":
        xq, xd, _, _ = quantize_q8_32_ref(x.reshape(-1))
        return (np.repeat(xd, 32) * xq.astype(np.float32)).reshape(x.shape)
    xq, xd, _ = quantize_q8_k_ref(x.reshape(-1))
    return (np.repeat(xd, 256) * xq.astype(np.float32)).reshape(x.shape)


def block_mins_ref(ggml_type, raw: np.ndarray) -> np.ndarray:
    """float32 (n_rows, n_blocks): the f16 m of every block of a Q4_1 / Q5_1 matrix (bytes 2..3)."""
    blocks = raw.reshape(raw.shape[0], -1, QUANT_TYPES[GGMLType(ggml_type)].type_size)
    return np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)


def linear_q8_ref(ggml_type, raw: np.ndarray, n_cols: int, x: np.ndarray) -> np.ndarray:
    """out (n_tok, n_rows) = x @ W.T with x in 8-bit blocks, as the CPU backend (llama.cpp's CPU) and the
    matvec_q8 kernels compute it, in float64: sum over blocks of W . (d_x q_x), where Q4_1 / Q5_1 add
    m_w * fp16(d_x * sum(q_x)) per block in place of m_w * fp16(d_x) * sum(q_x)."""
    w = dequantize_ref(ggml_type, raw, n_cols).astype(np.float64)
    fmt = act_format(ggml_type)
    out = requantized_ref(fmt, x).astype(np.float64) @ w.T
    if GGMLType(ggml_type) in Q8_1_WEIGHTS:
        _, xd, xs, xm = quantize_q8_32_ref(x.reshape(-1))
        error = (xm.astype(np.float64) - xd.astype(np.float64) * xs).reshape(x.shape[0], -1)
        out += error @ block_mins_ref(ggml_type, raw).astype(np.float64).T
    return out


# Block-quantized KV cache (kv_quant.cu): ggml's quantize_row_q8_0_ref / quantize_row_q4_0_ref
KV_QUANT_TYPES = {"q8_0": GGMLType.Q8_0, "q4_0": GGMLType.Q4_0}


def quantize_kv_ref(ggml_type, x: np.ndarray) -> np.ndarray:
    """x float32 (n_rows, n) -> uint8 (n_rows, n / 32 * type_size), a block at a time in float32 steps.
    Q8_0 (x86's quantize_row_q8_0, what llama.cpp's CPU writes its cache with): d = amax / 127,
    id = 127 / amax (0 if amax == 0), q = round-half-to-even(x * id).
    Q4_0: v = the first value of largest magnitude, d = v / -8, id = 1 / d (0 if d == 0),
    q = min(15, trunc(x * id + 8.5)), byte j = q[j] | q[j + 16] << 4. Both: the f16 of d first."""
    f32 = np.float32
    out = []
    for blk in np.asarray(x, f32).reshape(-1, 32):
        if GGMLType(ggml_type) == GGMLType.Q8_0:
            amax = f32(np.abs(blk).max())
            d = amax / f32(127)
            inv = f32(127) / amax if amax != 0 else f32(0)
            q = [round(float(f32(v * inv))) for v in blk]  # Python's round: half to even
            qs = np.array(q, np.int8).view(np.uint8)
        else:
            d = blk[int(np.abs(blk).argmax())] / f32(-8)  # argmax: the first of equal magnitudes
            inv = f32(1) / d if d != 0 else f32(0)
            q = [min(15, int(f32(f32(v * inv) + f32(8.5)))) for v in blk]  # int(): truncation
            qs = np.array([q[j] | (q[j + 16] << 4) for j in range(16)], np.uint8)
        out.append(np.concatenate([np.array([d], np.float16).view(np.uint8), qs]))
    return np.concatenate(out).reshape(x.shape[0], -1)


def hard_kv(n_rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 (n_rows >= 4, n >= 64) K or V rows that exercise the KV quantizers' corners: a block of
    zeros; largest magnitudes appearing as +v and -v (the first one sets Q4_0's sign); Q8_0's
    x * id at exactly k + 0.5 (half to even, not away from zero); Q4_0's x * id + 8.5 at exact
    integers and past 15 (the clamp); ordinary normal values."""
    x = (rng.standard_normal((n_rows, n)) * 2).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 3], x[1, 20] = 50.0, -50.0  # +v first
    x[1, 40], x[1, 41] = -50.0, 50.0  # -v first (lanes 17 apart, then neighbours)
    x[2, :32] = (np.arange(32) - 16 + 0.5).astype(np.float32) / np.float32(64)  # Q8_0: id = 64, x * id = k + 0.5
    x[2, 0] = np.float32(127 / 64)
    # Q4_0 with d = 1 (x[3, 0] = -8): x + 8.5 = k + 1 exactly (values 0..15), then k + 0.75 (truncated
    # to k, not rounded), and x[3, 31] + 8.5 = 16.25 clamped to 15
    x[3, :32] = np.arange(32) % 16 - np.float32(8) + np.where(np.arange(32) < 16, np.float32(0.5), np.float32(0.25))
    x[3, 0], x[3, 31] = -8.0, 7.75
    return x


def quantized_kv_steps(gpu, cpu, kind: str, rng: np.random.Generator):
    """The same K, V and q through a one-layer q8_0 / q4_0 paged cache on the GPU backend and on the
    CPU backend: two sequences, a 21-token prompt, then a ragged step (its next token alone + a 5-token
    prompt of the other); hd_k 64 != hd_v 32, GQA 2, K and V with hard_kv's corners. Yields per step
    (name, got, want, exact): the GPU's K and V blocks against the CPU's and quantize_kv_ref's (exact),
    then attention against attention_ref over the CPU's blocks dequantized (within float32 summation
    order)."""
    from types import SimpleNamespace

    from edgellm.kv_cache import KVCache
    from paged import attention_step

    cp = gpu.cp
    cfg = SimpleNamespace(n_layer=1, n_head_kv=2, head_dim_k=64, head_dim_v=32, sliding_window=0, swa_layers=[False])
    n_head, ggml_type = 4, KV_QUANT_TYPES[kind]
    caches = {"gpu": KVCache(cfg, [gpu], n_ctx=48, n_batch=32, n_seq=2, kv_type=kind),
              "cpu": KVCache(cfg, [cpu], n_ctx=48, n_batch=32, n_seq=2, kv_type=kind)}
    seqs = {d: (c.new_sequence(), c.new_sequence()) for d, c in caches.items()}
    scale = 1.0 / math.sqrt(cfg.head_dim_k)
    for step in ([(0, 21)], [(0, 1), (1, 5)]):  # (sequence, tokens)
        n_tok = sum(n for _, n in step)
        k = hard_kv(n_tok * cfg.n_head_kv, cfg.head_dim_k, rng).reshape(n_tok, cfg.n_head_kv, -1)
        v = hard_kv(n_tok, 64, rng)[::-1].reshape(n_tok, cfg.n_head_kv, cfg.head_dim_v)  # corners last
        q = rng.standard_normal((n_tok, n_head, cfg.head_dim_k)).astype(np.float32)
        outs = {}
        for d, cache in caches.items():
            b, up = (gpu, cp.asarray) if d == "gpu" else (cpu, np.ascontiguousarray)
            out = up(np.zeros((n_tok, n_head * cfg.head_dim_v), np.float32))
            pos = attention_step(b, cache, seqs[d], step, k, v, q, scale, out, up)  # (the same on both)
            outs[d] = out.get() if d == "gpu" else out
        g, c = caches["gpu"].layers[0], caches["cpu"].layers[0]
        gk, gv, slots = g.k.get(), g.v.get(), g.layout.slots
        label = f"{kind} KV step of {n_tok} tokens"
        yield f"{label}: K blocks = CPU backend's", gk, c.k.copy(), True  # every slot, written or not
        yield f"{label}: V blocks = CPU backend's", gv, c.v.copy(), True
        yield (f"{label}: K blocks = quantize_kv_ref", gk[slots].reshape(n_tok * cfg.n_head_kv, -1),
               quantize_kv_ref(ggml_type, k.reshape(n_tok * cfg.n_head_kv, -1)), True)
        yield (f"{label}: V blocks = quantize_kv_ref", gv[slots].reshape(n_tok * cfg.n_head_kv, -1),
               quantize_kv_ref(ggml_type, v.reshape(n_tok * cfg.n_head_kv, -1)), True)
        # attention: the GPU reads the blocks dequantized to float32 (the CPU follows llama.cpp's flash
        # attention instead: the query through 8 bits, integer dot products), so its twin is the float
        # attention over the dequantized blocks, each token over its own sequence's keys
        from gguf.quants import dequantize

        kd = dequantize(c.k.reshape(-1, c.k.shape[-1]), ggml_type).reshape(*c.k.shape[:2], -1)
        vd = dequantize(c.v.reshape(-1, c.v.shape[-1]), ggml_type).reshape(*c.v.shape[:2], -1)
        lay = c.layout
        want = np.concatenate([
            attention_ref(q[t:t + 1], kd[keys], vd[keys], c.pos[keys], pos[t:t + 1], scale)
            for t, keys in enumerate(lay.kmap[b:e] for b, e in zip(lay.kbeg, lay.kend))])
        yield f"{label}: attention = the float twin over the CPU's blocks", outs["gpu"], want, False


def rms_norm_ref(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """Over the last axis: x / sqrt(mean(x^2) + eps) * w."""
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (y * w if w is not None else y).astype(np.float32)


def rope_ref(x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float, neox: bool,
             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """x (n_tok, n_head, head_dim) rotated: pair i turns by pos * freq_scale * base^(-2i/n_rot) (/ factor i);
    normal layout pairs (2i, 2i+1), neox pairs (i, i + n_rot/2); dims >= n_rot unchanged."""
    out = x.astype(np.float64)
    for t in range(x.shape[0]):
        for i in range(n_rot // 2):
            theta = pos[t] * freq_base ** (-2.0 * i / n_rot)
            if freq_factors is not None:
                theta /= freq_factors[i]
            theta *= freq_scale
            a, b = (i, i + n_rot // 2) if neox else (2 * i, 2 * i + 1)
            x0, x1 = out[t, :, a].copy(), out[t, :, b].copy()
            out[t, :, a] = x0 * math.cos(theta) - x1 * math.sin(theta)
            out[t, :, b] = x0 * math.sin(theta) + x1 * math.cos(theta)
    return out.astype(np.float32)


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, kv_pos: np.ndarray, q_pos: np.ndarray,
                  scale: float, window: int = 0) -> np.ndarray:
    """q (n_tok, n_head, hd_k); k (n_slots, n_kv_head, hd_k), v (n_slots, n_kv_head, hd_v) in the cache
    dtype; kv_pos (n_slots,) position per slot (-1 empty); out (n_tok, n_head * hd_v).
    Query at position p sees slots with 0 <= kv_pos <= p and (window > 0) p - kv_pos < window.
    q is rounded to the cache dtype first, like ggml's f16 K x f32 Q product."""
    n_tok, n_head, _ = q.shape
    n_kv_head, hd_v = k.shape[1], v.shape[2]
    group = n_head // n_kv_head
    qr = q.astype(k.dtype).astype(np.float64)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    out = np.zeros((n_tok, n_head, hd_v))
    for t in range(n_tok):
        p = q_pos[t]
        visible = (kv_pos >= 0) & (kv_pos <= p)
        if window > 0:
            visible &= p - kv_pos < window
        slots = np.flatnonzero(visible)
        for h in range(n_head):
            s = k64[slots, h // group] @ qr[t, h] * scale
            e = np.exp(s - s.max())
            out[t, h] = e @ v64[slots, h // group] / e.sum()
    return out.reshape(n_tok, n_head * hd_v).astype(np.float32)


def silu_mul_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = gate.astype(np.float64)
    return (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


def gelu_mul_ref(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml's), times up."""
    g = gate.astype(np.float64)
    return (0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))) * up).astype(np.float32)


def random_blocks(ggml_type, n_blocks: int, rng: np.random.Generator, scale: float = 0.1) -> np.ndarray:
    """uint8 (n_blocks * type_size,) of valid blocks: random bytes (every bit pattern of the packed
    fields) with f16 scales of magnitude <= scale; float types hold standard normal values."""
    ggml_type = GGMLType(ggml_type)
    qt = QUANT_TYPES[ggml_type]
    n = n_blocks * qt.block_size
    if ggml_type == GGMLType.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if ggml_type == GGMLType.F16:
        return rng.standard_normal(n).astype(np.float16).view(np.uint8)
    if ggml_type == GGMLType.BF16:
        return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(n_blocks, qt.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[ggml_type]:
        scales = (rng.uniform(0.01, 1.0, n_blocks) * scale * rng.choice([-1, 1], n_blocks)).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if ggml_type == GGMLType.IQ1_M:
        set_iq1_m_d(raw, (rng.uniform(0.01, 1.0, n_blocks) * scale).astype(np.float32))
    return raw.reshape(-1)


# ============================================================================ tests (CI, no GPU)
# The references must agree with the CPU backend (the other implementation of the same ops) and with
# facts that do not depend on either.

RNG = np.random.default_rng(1234)


def _cpu():
    from edgellm.kernels.cpu.backend import CPUBackend

    return CPUBackend()


def test_rms_norm_ref_matches_cpu_backend_and_has_unit_rms():
    x = RNG.standard_normal((5, 96)).astype(np.float32) * 3
    w = RNG.standard_normal(96).astype(np.float32)
    out = np.empty_like(x)
    _cpu().rms_norm(x, w, 1e-6, out)
    np.testing.assert_allclose(rms_norm_ref(x, w, 1e-6), out, rtol=1e-5, atol=1e-6)
    unweighted = rms_norm_ref(x, None, 0.0)
    np.testing.assert_allclose(np.sqrt(np.mean(unweighted.astype(np.float64) ** 2, axis=-1)), 1.0, rtol=1e-6)
    # per-head QK-norm: rows are (token, head)
    x3 = RNG.standard_normal((3, 4, 32)).astype(np.float32)
    w3 = RNG.standard_normal(32).astype(np.float32)
    out3 = x3.copy()
    _cpu().rms_norm(out3, w3, 1e-6, out3)
    np.testing.assert_allclose(rms_norm_ref(x3, w3, 1e-6), out3, rtol=1e-5, atol=1e-6)


def test_rope_ref_matches_cpu_backend_both_layouts():
    x = RNG.standard_normal((6, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 2047, 5], dtype=np.int64)
    for neox in (False, True):
        for n_rot in (64, 32):
            got = x.copy()
            _cpu().rope(got, pos, n_rot, 10000.0, 0.5, neox)
            np.testing.assert_allclose(rope_ref(x, pos, n_rot, 10000.0, 0.5, neox), got, rtol=1e-4, atol=2e-4)


def test_rope_ref_facts():
    x = RNG.standard_normal((4, 2, 16)).astype(np.float32)
    pos = np.array([0, 3, 9, 30])
    y = rope_ref(x, pos, 12, 500.0, 1.0, neox=False)
    np.testing.assert_allclose(y[0], x[0], atol=1e-6)  # position 0 is the identity
    np.testing.assert_array_equal(y[:, :, 12:], x[:, :, 12:])  # dims >= n_rot untouched
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)  # a rotation
    # neox is the normal layout on permuted dimensions: (i, i + n/2) <-> (2i, 2i + 1)
    perm = np.empty(12, dtype=int)
    perm[0::2], perm[1::2] = np.arange(6), np.arange(6, 12)
    xp = x.copy()
    xp[:, :, :12] = x[:, :, perm]
    neox = rope_ref(x, pos, 12, 500.0, 1.0, neox=True)
    np.testing.assert_allclose(rope_ref(xp, pos, 12, 500.0, 1.0, neox=False)[:, :, :12], neox[:, :, perm], atol=1e-5)
    # pair i at position p turns by exactly p * base^(-2i/n): check pair 1 of token 1
    theta = 3 * 500.0 ** (-2 / 12)
    a, b = x[1, 0, 2], x[1, 0, 3]
    np.testing.assert_allclose(y[1, 0, 2:4], [a * math.cos(theta) - b * math.sin(theta),
                                               a * math.sin(theta) + b * math.cos(theta)], rtol=1e-5)


def _filled_cpu_cache(n_slots, n_kv, hd, dtype, window, positions, rng):
    b = _cpu()
    kv = b.kv_layer(n_slots, n_kv, hd, hd, dtype, window)
    for p in positions:  # one token at a time, as decode does; the ring wraps when positions > n_slots
        k = rng.standard_normal((1, n_kv, hd)).astype(np.float32)
        v = rng.standard_normal((1, n_kv, hd)).astype(np.float32)
        b.kv_store(kv, k, v, np.array([p]))
    return b, kv


def test_attention_ref_matches_cpu_backend_gqa_window_ring():
    rng = np.random.default_rng(7)
    for dtype, window, n_slots in ((np.float16, 0, 40), (np.float32, 0, 40), (np.float16, 8, 12)):
        b, kv = _filled_cpu_cache(n_slots, 2, 32, dtype, window, range(30), rng)
        q = rng.standard_normal((3, 6, 32)).astype(np.float32)
        q_pos = np.array([27, 28, 29])
        out = np.empty((3, 6 * 32), dtype=np.float32)
        b.attention(q, kv, q_pos, 0.2, out)
        ref = attention_ref(q, kv.k, kv.v, kv.pos, q_pos, 0.2, window)
        # the CPU backend rounds the probabilities to the cache type before the P V product, as
        # ggml does (f16: relative 2^-11 per weight); the CUDA kernel's online softmax does not
        rtol = 2e-3 if dtype == np.float16 else 1e-4
        np.testing.assert_allclose(ref, out, rtol=rtol, atol=rtol / 10)


def test_attention_ref_facts():
    rng = np.random.default_rng(3)
    k = rng.standard_normal((10, 1, 8)).astype(np.float32)
    v = rng.standard_normal((10, 1, 8)).astype(np.float32)
    kv_pos = np.arange(10)
    q = rng.standard_normal((2, 2, 8)).astype(np.float32)
    # window 1: each query sees only its own key, so the output is its own value, for every head
    out = attention_ref(q, k, v, kv_pos, np.array([4, 9]), 1.0, window=1).reshape(2, 2, 8)
    np.testing.assert_allclose(out[0], np.stack([v[4, 0]] * 2), rtol=1e-6)
    np.testing.assert_allclose(out[1], np.stack([v[9, 0]] * 2), rtol=1e-6)
    # position 0 sees only key 0
    out0 = attention_ref(q[:1], k, v, kv_pos, np.array([0]), 1.0).reshape(2, 8)
    np.testing.assert_allclose(out0, np.stack([v[0, 0]] * 2), rtol=1e-6)
    # scale 0: a plain average of the visible values
    avg = attention_ref(q[:1], k, v, kv_pos, np.array([5]), 0.0).reshape(2, 8)
    np.testing.assert_allclose(avg[0], v[:6, 0].mean(axis=0), rtol=1e-5)


def test_activation_refs_match_cpu_backend_and_known_values():
    gate = np.linspace(-8, 8, 101, dtype=np.float32)
    up = RNG.standard_normal(101).astype(np.float32)
    out = np.empty_like(gate)
    _cpu().silu_mul(gate, up, out)
    np.testing.assert_allclose(silu_mul_ref(gate, up), out, rtol=1e-5, atol=1e-6)
    _cpu().gelu_mul(gate, up, out)
    # the CPU backend reads GELU from ggml's f16 table (input and output rounded to f16, relative
    # 2^-11 each); the reference and the CUDA kernel use the formula in float32
    np.testing.assert_allclose(gelu_mul_ref(gate, up), out, rtol=2e-3, atol=2e-3)
    ones = np.ones(3, dtype=np.float32)
    x = np.array([0.0, 1.0, -1.0], dtype=np.float32)
    np.testing.assert_allclose(silu_mul_ref(x, ones), [0.0, 0.7310585786, -0.2689414214], rtol=1e-6)
    np.testing.assert_allclose(gelu_mul_ref(x, ones), [0.0, 0.8411919906, -0.1588080094], rtol=1e-6)


def test_random_blocks_are_valid_for_every_type():
    for ggml_type, qt in QUANT_TYPES.items():
        raw = random_blocks(ggml_type, 8, np.random.default_rng(0))
        assert raw.size == 8 * qt.type_size
        w = dequantize_ref(ggml_type, raw.reshape(1, -1), 8 * qt.block_size)
        assert np.isfinite(w).all() and np.abs(w).max() > 0, qt.name


def test_linear_ref_is_a_matrix_product():
    w = np.array([[1, 2], [3, 4], [5, 6]], dtype=np.float32)
    x = np.array([[1, -1], [0.5, 2]], dtype=np.float32)
    np.testing.assert_array_equal(linear_ref(w, x), [[-1, -1, -1], [4.5, 9.5, 14.5]])


def hard_activations(n_tok: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """float32 (n_tok, n) that exercise the 8-bit quantizers' corners: a block of zeros, a block whose
    largest magnitude appears as +v and -v (the first one sets q8_k's sign), values x * 127 / amax at
    exactly k + 0.5 (round half to even), and ordinary normal values."""
    x = (rng.standard_normal((n_tok, n)) * 2).astype(np.float32)
    x[0, :256] = 0.0  # a zero block in both formats
    if n_tok > 1:  # ties of magnitude: the value at the lower index counts (8 apart: other GPU lanes)
        x[1, 256 + 200], x[1, 256 + 3] = -50.0, 50.0
        x[1, 13], x[1, 10] = 50.0, -50.0
    if n_tok > 2:  # amax 127 / 64: 127 / amax = 64 exactly, so x * 64 = k + 0.5 exactly
        x[2, 256:288] = (np.arange(32) - 16 + 0.5).astype(np.float32) / np.float32(64)
        x[2, 256] = np.float32(127 / 64)
    return x


def test_q8_activation_refs_equal_the_cpu_backends_bits():
    """quantize_q8_32_ref / quantize_q8_k_ref are the CPU backend's activation quantizers, bit for bit."""
    from edgellm.kernels import cpu as kcpu

    rng = np.random.default_rng(11)
    x = hard_activations(3, 512, rng)
    for row in x:
        got = kcpu.quantize("q8_32", row).parts
        for a, b in zip(quantize_q8_32_ref(row), got):
            np.testing.assert_array_equal(a, b)
        got = kcpu.quantize("q8_k", row).parts
        for a, b in zip(quantize_q8_k_ref(row), got[:3]):
            np.testing.assert_array_equal(a, b)
    for fmt in ("q8_32", "q8_k"):
        np.testing.assert_array_equal(requantized_ref(fmt, x), kcpu.requantize(fmt, x))
    xq, xd, _ = quantize_q8_k_ref(x[1])
    assert xd[1] < 0 and xq[256 + 3] == -127 and xq[256 + 200] == 127  # the +50 at the lower index sets the sign
    assert xd[0] > 0 and xq[10] == -127 and xq[13] == 127
    xq, _, _, _ = quantize_q8_32_ref(x[2])
    np.testing.assert_array_equal(xq[257:288], np.rint(np.arange(1, 32) - 15.5))  # ties to even
    assert (xq[257:288] % 2 == 0).all()


def test_linear_q8_ref_matches_the_cpu_backend_for_every_quant_type():
    """The twin of the matvec_q8 kernels equals the CPU backend's products (llama.cpp's integer order)
    to float rounding, one token (matvec) and a batch (matmul); and it is not the float product."""
    from edgellm.kernels import cpu as kcpu

    rng = np.random.default_rng(12)
    for ggml_type, qt in QUANT_TYPES.items():
        if qt.block_size == 1:
            continue
        n_rows, n_cols = 9, 512
        raw = random_blocks(ggml_type, n_rows * n_cols // qt.block_size, rng).reshape(n_rows, -1)
        x = hard_activations(3, n_cols, rng)
        want = linear_q8_ref(ggml_type, raw, n_cols, x)
        m = kcpu.bind(ggml_type, raw, n_cols)
        got = np.empty((3, n_rows), np.float32)
        m.matmul(x, got)
        one = np.empty(n_rows, np.float32)
        m.matvec(x[1], one)
        bound = np.abs(requantized_ref(act_format(ggml_type), x)).astype(np.float64) @ np.abs(
            dequantize_ref(ggml_type, raw, n_cols)).T.astype(np.float64)
        assert np.max(np.abs(got - want) / bound) < 2e-6, qt.name
        assert np.max(np.abs(one - want[1]) / bound[1]) < 2e-6, qt.name
        float_product = linear_ref(dequantize_ref(ggml_type, raw, n_cols), x)
        assert np.max(np.abs(float_product - want) / bound) > 1e-4, qt.name  # 8 bits are visible


def test_kv_quantizer_ref_equals_the_cpu_backends_cache_bytes():
    """quantize_kv_ref is what the CPU backend's kv_store writes (kernels.cpu.numpy_backend.quantize_kv_rows:
    Q8_0 as x86's quantize_row_q8_0, Q4_0 as ggml's reference), byte for byte, on the corners hard_kv
    plants; and known values."""
    from edgellm.kernels.cpu.numpy_backend import quantize_kv_rows

    x = hard_kv(6, 64, np.random.default_rng(12))
    for kind, ggml_type in KV_QUANT_TYPES.items():
        np.testing.assert_array_equal(quantize_kv_ref(ggml_type, x), quantize_kv_rows(x, ggml_type), err_msg=kind)
    q8 = quantize_kv_ref(GGMLType.Q8_0, x[2:3, :32])[0]
    assert q8[:2].view(np.float16)[0] == np.float16(1 / 64)
    # 127 / 64 -> 127; x * 64 = -14.5 .. 15.5 rounds half to even: -14.5 -> -14, -0.5 -> 0, 15.5 -> 16
    # (away from zero, ggml's reference quantizer: -15, -1, 16)
    np.testing.assert_array_equal(q8[2:].view(np.int8), [127, *[2 * (k // 2) - 14 for k in range(30)], 16])
    q4 = quantize_kv_ref(GGMLType.Q4_0, x[1:4])  # (3 rows, 2 blocks of 18 bytes)
    assert q4[0, :2].view(np.float16)[0] == np.float16(-6.25) and q4[0, 18:20].view(np.float16)[0] == 6.25
    nibbles = np.concatenate([q4[2, 2:18] & 15, q4[2, 2:18] >> 4])
    np.testing.assert_array_equal(nibbles, [0, *range(2, 16), 15, 0, *range(1, 15), 15])
