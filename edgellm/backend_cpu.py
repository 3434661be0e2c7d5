"""CPU backend: the ops model code calls, on NumPy arrays; quantized products run in Numba kernels.

Every op writes into an out-parameter (or works in place). The arithmetic follows ggml's CPU code
where the order of rounding matters for matching llama.cpp: RMSNorm sums squares in float64 and
scales in float32; RoPE angles are built by repeated float32 multiplication like ggml's rope cache;
softmax is float32 with the max subtracted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgellm.gguf_file import TensorInfo

F32 = np.float32


@dataclass(frozen=True)
class QMatrix:
    """A weight matrix kept in its quantized blocks: data uint8 (n_rows, row_bytes)."""

    ggml_type: int
    data: np.ndarray
    n_rows: int
    n_cols: int
    name: str = ""

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class KVLayer:
    """One layer's K and V cache on the layer's device.

    size slots of (n_kv_head, head_dim); a token at position p lives in slot p % size, so a
    sliding-window layer needs only window + n_batch slots. `pos[slot]` is the position held (-1: empty).
    """

    def __init__(self, xp, size: int, n_kv_head: int, head_dim_k: int, head_dim_v: int, dtype, window: int = 0):
        self.size = size
        self.window = window
        self.k = xp.zeros((size, n_kv_head, head_dim_k), dtype=dtype)
        self.v = xp.zeros((size, n_kv_head, head_dim_v), dtype=dtype)
        self.pos = np.full(size, -1, dtype=np.int64)  # host-side bookkeeping
        self.n_used = 0  # slots [0, n_used) may hold data

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def clear(self) -> None:
        self.pos[:] = -1
        self.n_used = 0

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.size


class CPUBackend:
    device = "cpu"
    xp = np

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._kernels = None

    # --- weights --------------------------------------------------------------------------
    @property
    def kernels(self):
        if self._kernels is None:
            from edgellm.kernels import cpu

            if self.threads:
                cpu.set_threads(self.threads)
            self._kernels = cpu
        return self._kernels

    def weight(self, t: TensorInfo):
        """Matrices stay quantized (views of the mapped file); vectors (norms, biases) become float32."""
        if len(t.ne) == 1:
            return np.ascontiguousarray(t.as_float32().reshape(-1))
        return QMatrix(int(t.qtype.ggml_type), t.data, t.n_rows, t.n_cols, t.name)

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, shape, dtype=F32) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def kv_layer(self, size, n_kv_head, head_dim_k, head_dim_v, dtype, window=0) -> KVLayer:
        return KVLayer(np, size, n_kv_head, head_dim_k, head_dim_v, dtype, window)

    def synchronize(self) -> None:
        pass

    # --- ops ------------------------------------------------------------------------------
    def embed(self, w: QMatrix, ids: np.ndarray, out: np.ndarray) -> None:
        """out (n_tok, n_embd) = rows `ids` of the embedding matrix, dequantized."""
        rows = np.ascontiguousarray(w.data[ids])
        self.kernels.dequantize(w.ggml_type, rows, out)

    def linear(self, w: QMatrix, x: np.ndarray, out: np.ndarray) -> None:
        """out (n_tok, n_rows) = x (n_tok, n_cols) @ W.T"""
        if x.shape[0] == 1:
            self.kernels.matvec(w.ggml_type, w.data, x[0], out[0])
        else:
            self.kernels.matmul(w.ggml_type, w.data, x, out)

    def add(self, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
        np.add(x, y, out=out)

    def rms_norm(self, x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray) -> None:
        """Over the last axis: out = x / sqrt(mean(x^2) + eps) * w."""
        sq = np.square(x, dtype=F32)
        mean = (np.sum(sq, axis=-1, dtype=np.float64) / x.shape[-1]).astype(F32)
        scale = F32(1.0) / np.sqrt(mean + F32(eps))
        np.multiply(x, scale[..., None], out=out)
        if w is not None:
            np.multiply(out, w, out=out)

    def rope(self, x: np.ndarray, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float,
             neox: bool) -> None:
        """In place on x (n_tok, n_head, head_dim). Normal layout rotates pairs (2i, 2i+1); neox
        rotates (i, i + n_rot/2). theta_i = pos * freq_scale * base^(-2i/n_rot)."""
        cos, sin = rope_cache(pos, n_rot, freq_base, freq_scale)  # (n_tok, n_rot/2)
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        half = n_rot // 2
        if neox:
            x0 = x[..., :half].copy()
            x1 = x[..., half:n_rot].copy()
            x[..., :half] = x0 * cos - x1 * sin
            x[..., half:n_rot] = x0 * sin + x1 * cos
        else:
            x0 = x[..., 0:n_rot:2].copy()
            x1 = x[..., 1:n_rot:2].copy()
            x[..., 0:n_rot:2] = x0 * cos - x1 * sin
            x[..., 1:n_rot:2] = x0 * sin + x1 * cos

    def kv_store(self, kv: KVLayer, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        slots = kv.slots(pos)
        kv.k[slots] = k
        kv.v[slots] = v
        kv.pos[slots] = pos
        kv.n_used = max(kv.n_used, int(slots.max()) + 1)

    def attention(self, q: np.ndarray, kv: KVLayer, pos: np.ndarray, scale: float, out: np.ndarray) -> None:
        """Causal (and sliding-window) attention of q (n_tok, n_head, hd_k) at positions `pos`
        over the cache; out (n_tok, n_head * hd_v). Softmax in float32; the query is rounded to
        f16 like ggml's f16 K · f32 Q product."""
        n_tok, n_head, hd = q.shape
        used = kv.n_used
        n_kv = kv.k.shape[1]
        g = n_head // n_kv
        k = kv.k[:used].astype(F32)  # (T, n_kv, hd)
        v = kv.v[:used].astype(F32)
        kpos = kv.pos[:used]
        qh = q.astype(kv.k.dtype).astype(F32).reshape(n_tok, n_kv, g, hd).transpose(1, 0, 2, 3)
        qh = qh.reshape(n_kv, n_tok * g, hd)
        s = np.matmul(qh, k.transpose(1, 2, 0))  # (n_kv, n_tok*g, T)
        s *= F32(scale)
        visible = (kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None])  # (n_tok, T)
        if kv.window:
            visible &= pos[:, None] - kpos[None, :] < kv.window
        visible = np.repeat(visible, g, axis=0)  # (n_tok*g, T)
        s = np.where(visible[None], s, F32(-np.inf))
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = np.matmul(s, v.transpose(1, 0, 2))  # (n_kv, n_tok*g, hd_v)
        hd_v = v.shape[-1]
        out[:] = o.reshape(n_kv, n_tok, g, hd_v).transpose(1, 0, 2, 3).reshape(n_tok, n_head * hd_v)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
        """out = silu(gate) * up"""
        with np.errstate(over="ignore"):  # exp(-gate) -> inf gives silu -> 0, as it should
            silu = gate / (F32(1.0) + np.exp(-gate))
        np.multiply(silu, up, out=out)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
        """out = gelu_tanh(gate) * up"""
        g = gate
        t = np.tanh(F32(math.sqrt(2.0 / math.pi)) * (g + F32(0.044715) * g * g * g))
        np.multiply(F32(0.5) * g * (F32(1.0) + t), up, out=out)

    def scale(self, x: np.ndarray, s: float) -> None:
        x *= F32(s)


def rope_cache(pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 (n_tok, n_rot/2); theta built like ggml: theta_0 = p, theta_{i+1} =
    theta_i * base^(-2/n_rot) in float32, then times freq_scale."""
    theta_scale = F32(freq_base ** (-2.0 / n_rot))
    theta = pos.astype(F32)
    out = np.empty((len(pos), n_rot // 2), dtype=F32)
    for i in range(n_rot // 2):
        out[:, i] = theta
        theta = theta * theta_scale
    out *= F32(freq_scale)
    return np.cos(out), np.sin(out)
