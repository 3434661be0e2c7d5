"""NumpyBackend: every op of edgellm.backend.Backend in plain NumPy, the reference twins of the
CPU backend's Numba kernels (tests/test_ops_cpu.py holds them together), and the NumPy helpers
both use. The arithmetic follows ggml's CPU code where the order of rounding matters for matching
llama.cpp: RMSNorm sums squares in float64 and scales in float32; RoPE angles are built by repeated
float32 multiplication like ggml's rope cache; softmax is float32 with the max subtracted.
"""
from __future__ import annotations

import functools

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.backend import Backend, KVLayer, QMatrix, RingKV, attention_layout
from edgellm.gguf_file import TensorInfo

F32 = np.float32



def quantize_kv_rows(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """uint8 (rows, row bytes): x's last axis as blocks of a quantized cache, with the quantizer
    llama.cpp's CPU backend writes its cache with (ggml's set_rows takes the type's CPU from_float):
    Q8_0 the x86 one (id = 127 / amax, round half to even: the CPU's q8_32 activation format),
    Q4_0 ggml's reference (it has no other)."""
    rows = np.ascontiguousarray(x, F32).reshape(-1, x.shape[-1])
    if ggml_type == GGMLType.Q8_0:
        from edgellm.kernels import cpu

        xq, xd = cpu.quantize("q8_32", rows.reshape(-1)).parts[:2]
        blocks = np.empty((xd.size, 34), np.uint8)
        blocks[:, :2] = xd.astype(np.float16).view(np.uint8).reshape(-1, 2)
        blocks[:, 2:] = xq.view(np.uint8).reshape(-1, 32)
        return blocks.reshape(rows.shape[0], -1)
    from gguf.quants import quantize

    return quantize(rows, ggml_type)


class NumpyBackend(Backend):
    """The ops in plain NumPy: the slow, obviously-correct twin of every Numba op of `CPUBackend`
    (tests/test_ops_cpu.py holds them together). Products already run in the Numba kernels."""

    device = "cpu"
    xp = np

    def __init__(self, threads: int | None = None, flash_attn: bool = False):
        self.threads = threads
        # flash_attn: an f16 cache is read as llama.cpp's CPU flash attention reads it (its tools'
        # default on the CPU) instead of its KQ / softmax / V^T P graph; a quantized cache always is
        self.flash_attn = bool(flash_attn)
        self._kernels = None
        self.rope_tables = RopeTables()

    def set_rope_factors(self, factors, mscale: float = 1.0) -> None:
        self.rope_tables.set_factors(factors, mscale)

    attn_softcap = F32(0.0)  # Gemma-2's soft cap on attention scores (0: none)

    def set_attn_softcap(self, cap: float) -> None:
        self.attn_softcap = F32(cap)

    def _check_softcap(self, kv) -> None:
        if self.attn_softcap > 0 and (getattr(kv, "quant", None) is not None or self.flash_attn):
            from edgellm.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(
                "soft-capped attention (gemma2) runs with an f16 or f32 KV cache and flash attention off "
                "only, for now: use --kv-type f16 and -fa off")

    # --- weights --------------------------------------------------------------------------
    @property
    def kernels(self):
        if self._kernels is None:
            from edgellm.kernels import cpu

            self._kernels = cpu
        return self._kernels

    def weight(self, t: TensorInfo):
        """Matrices stay quantized (views of the mapped file); vectors (norms, biases) become float32."""
        if len(t.ne) == 1:  # a copy: writable, as the fused decode kernel's views of them are (one
            # compiled variant of the norm kernels for both)
            return np.array(t.as_float32().reshape(-1), dtype=F32, copy=True)
        return QMatrix(int(t.qtype.ggml_type), t.data, t.n_rows, t.n_cols, t.name)

    def from_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return x

    def empty(self, shape, dtype=F32) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def kv_layer(self, size, n_kv_head, head_dim_k, head_dim_v, dtype, window=0) -> RingKV:
        return RingKV(np, size, n_kv_head, head_dim_k, head_dim_v, dtype, window)

    def kv_array(self, shape, dtype) -> np.ndarray:
        """A KV cache array, its pages committed now (memory runs out at load, never mid-generation)."""
        a = np.zeros(shape, dtype=dtype)
        a.fill(0)
        return a

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
        cos, sin = self.rope_tables.get(n_rot, freq_base, freq_scale, int(pos.max()) + 1)
        cos = cos[pos][:, None, :]  # (n_tok, 1, n_rot/2)
        sin = sin[pos][:, None, :]
        half = n_rot // 2
        i0 = np.arange(half) if neox else np.arange(0, n_rot, 2)
        i1 = i0 + half if neox else i0 + 1
        x0 = x[..., i0].astype(np.float64)
        x1 = x[..., i1].astype(np.float64)
        # ggml's fma(x0, cos, -(x1 sin)) and fma(x0, sin, x1 cos): exact products in float64
        x[..., i0] = (x0 * cos - (x1 * sin).astype(F32)).astype(F32)
        x[..., i1] = (x0 * sin + (x1 * cos).astype(F32)).astype(F32)

    def kv_store(self, kv: KVLayer, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        slots = kv.slots(pos)
        quant = getattr(kv, "quant", None)
        if quant is not None:  # each head's values quantized as one row of blocks, as llama.cpp's CPU does
            k = quantize_kv_rows(k, quant.ggml_type).reshape(kv.k[slots].shape)
            v = quantize_kv_rows(v, quant.ggml_type).reshape(kv.v[slots].shape)
        kv.k[slots] = k
        kv.v[slots] = v
        kv.pos[slots] = pos
        if isinstance(kv, RingKV):
            kv.n_used = max(kv.n_used, int(slots.max()) + 1)

    def attention(self, q: np.ndarray, kv: KVLayer, pos: np.ndarray, scale: float, out: np.ndarray) -> None:
        """Causal (and sliding-window) attention of q (n_tok, n_head, hd_k) at positions `pos`
        over the cache; out (n_tok, n_head * hd_v). Each token attends to its key list (the step
        layout): alone (ggml's one-token order) or with the other tokens of its chunk (the batch
        order)."""
        self._check_softcap(kv)
        if getattr(kv, "quant", None) is not None:  # llama.cpp reads these through flash attention
            return self._attention_flash_quant_ref(q, kv, pos, scale, out)
        if self.flash_attn:
            return self._attention_flash_f16_ref(q, kv, pos, scale, out)
        kmap, kbeg, kend, n_single, chunks = attention_layout(kv, q.shape[0])
        groups = [(t, t + 1) for t in range(n_single)] + list(chunks)
        for t0, t1 in groups:
            keys = kmap[kbeg[t0]:kend[t0]]
            kc, vc = kv.k[keys], kv.v[keys]
            self._attend(q[t0:t1], kc, vc, kv.pos[keys], pos[t0:t1], kv.window, scale, out[t0:t1])

    def _attention_flash_quant_ref(self, q, kv, pos, scale, out) -> None:
        """A q8_0 / q4_0 cache: ggml's CPU flash attention, head by head (reference.flash_attn_quant)."""
        from edgellm.kernels import cpu
        from edgellm.kernels.cpu import reference as ref

        kmap, kbeg, kend, _, _ = attention_layout(kv, q.shape[0])
        n_tok, n_head, _ = q.shape
        g = n_head // kv.k.shape[1]
        hdv = out.shape[1] // n_head
        q4 = kv.quant.ggml_type == GGMLType.Q4_0
        for t in range(n_tok):
            keys = kmap[kbeg[t]:kend[t]]
            kp = kv.pos[keys]
            keys = keys[(kp >= 0) & (kp <= pos[t]) & ((kv.window <= 0) | (pos[t] - kp < kv.window))]
            for h in range(n_head):
                xq, xd = cpu.quantize("q8_32", np.ascontiguousarray(q[t, h], F32)).parts[:2]
                out[t, h * hdv:(h + 1) * hdv] = ref.flash_attn_quant(xq, xd, kv.k[keys, h // g], kv.v[keys, h // g],
                                                                     q4, q4, scale)

    def flash_splits(self) -> int:
        """The cell ranges of llama.cpp's split-KV decode kernel: its thread count (-t), here
        `threads` (else the kernels' thread count)."""
        if self.threads:
            return int(self.threads)
        import numba

        return numba.get_num_threads()

    def _flash_f16_steps(self, kv, n_tok):
        """(kmap, kbeg, kend, kernel name per token, n_cells per token) of a step over an f16 cache
        read by flash attention: a token alone gets the decode kernel (split-KV from 512 cells on),
        a chunk of a sequence's tokens the one-chunk (2..63 rows) or tiled (64+) kernel."""
        from edgellm.kernels.cpu import reference as ref

        if kv.k.dtype != np.float16:
            from edgellm.errors import InvalidArgumentError

            raise InvalidArgumentError(f"flash attention reads an f16 or quantized KV cache, not {kv.k.dtype}; "
                                       "use kv_type='f16' or flash_attn='off'")
        if kv.k.shape[2] % 32:
            from edgellm.errors import InvalidArgumentError

            raise InvalidArgumentError(f"flash attention over an f16 cache needs a key head size divisible by 32, "
                                       f"not {kv.k.shape[2]}; use flash_attn='off'")
        kmap, kbeg, kend, n_single, chunks = attention_layout(kv, n_tok)
        kinds, cells = [None] * n_tok, np.zeros(n_tok, np.int64)
        for t in range(n_single):
            used = int(kv.pos[kmap[kbeg[t]:kend[t]]].max(initial=-1)) + 1  # its highest cell + 1
            cells[t] = ref.flash_cells(used)
            kinds[t] = ref.flash_kernel(1, int(cells[t]))
        for t0, t1 in chunks:
            kinds[t0:t1] = [ref.flash_kernel(t1 - t0, 0)] * (t1 - t0)
        return kmap, kbeg, kend, kinds, cells

    def _attention_flash_f16_ref(self, q, kv, pos, scale, out) -> None:
        """An f16 cache through ggml's CPU flash attention, head by head (reference.flash_attn_f16)."""
        from edgellm.kernels.cpu import reference as ref

        kmap, kbeg, kend, kinds, cells = self._flash_f16_steps(kv, q.shape[0])
        n_tok, n_head, _ = q.shape
        g = n_head // kv.k.shape[1]
        hdv = out.shape[1] // n_head
        for t in range(n_tok):
            keys = kmap[kbeg[t]:kend[t]]
            kp = kv.pos[keys]
            vis = (kp >= 0) & (kp <= pos[t]) & ((kv.window <= 0) | (pos[t] - kp < kv.window))
            keys, kp = keys[vis], kp[vis]
            for h in range(n_head):
                out[t, h * hdv:(h + 1) * hdv] = ref.flash_attn_f16(
                    np.asarray(q[t, h], F32), kv.k[keys, h // g], kv.v[keys, h // g], kp, scale, kinds[t],
                    int(cells[t]), self.flash_splits())

    def _attend(self, q, kc, vc, kpos, pos, window, scale, out) -> None:
        """q (n_tok, n_head, hd_k) over the keys kc, vc (T, n_kv, hd) at positions kpos (-1: empty).
        Softmax in float32; the query is rounded to the cache type like ggml's f16 K · f32 Q product."""
        n_tok, n_head, hd = q.shape
        n_kv = kc.shape[1]
        g = n_head // n_kv
        k = kc.astype(F32)  # (T, n_kv, hd)
        v = vc.astype(F32)
        qh = q.astype(kc.dtype).astype(F32).reshape(n_tok, n_kv, g, hd).transpose(1, 0, 2, 3)
        qh = qh.reshape(n_kv, n_tok * g, hd)
        # scores summed in ggml's lane order (vec_dot_f16 for one token, tinyBLAS for a batch), so
        # that the probabilities round to f16 as the kernel's do
        from edgellm.kernels.cpu.reference import dot_f16

        n_acc = 4 if n_tok == 1 and hd % 32 == 0 else 1
        s = np.stack([np.stack([dot_f16(k[:, h], row, n_acc) for row in qh[h]]) for h in range(n_kv)])
        if self.attn_softcap > 0:  # cap * tanhf(s / cap), each op in float32 as ggml's graph
            flat = np.ascontiguousarray(s).reshape(-1)
            self.kernels._import("ops").soft_cap(flat, self.attn_softcap)
            s = flat.reshape(s.shape)
        s *= F32(scale)
        visible = (kpos[None, :] >= 0) & (kpos[None, :] <= pos[:, None])  # (n_tok, T)
        if window:
            visible &= pos[:, None] - kpos[None, :] < window
        visible = np.repeat(visible, g, axis=0)  # (n_tok*g, T)
        s = np.where(visible[None], s, F32(-np.inf))
        s -= s.max(axis=-1, keepdims=True)
        s = expf_ggml(s)
        s *= (1.0 / softmax_total(s)).astype(F32)
        s = s.astype(vc.dtype).astype(F32)  # ggml rounds P to the V cache type for the P V product
        o = np.matmul(s, v.transpose(1, 0, 2))  # (n_kv, n_tok*g, hd_v)
        hd_v = v.shape[-1]
        out[:] = o.reshape(n_kv, n_tok, g, hd_v).transpose(1, 0, 2, 3).reshape(n_tok, n_head * hd_v)

    def silu_mul(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
        """out = silu(gate) * up"""
        with np.errstate(over="ignore"):  # exp(-gate) -> inf gives silu -> 0, as it should
            silu = gate / (F32(1.0) + np.exp(-gate))
        np.multiply(silu, up, out=out)

    def gelu_mul(self, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
        """out = gelu_tanh(gate) * up, as ggml's CPU computes it: for |gate| < 10 the GELU is read
        from a table of f16 values indexed by gate rounded to f16; 0 below -10, identity above 10."""
        table = gelu_f16_table()
        y = table[gate.astype(np.float16).view(np.uint16)]
        y = np.where(gate <= F32(-10.0), F32(0.0), np.where(gate >= F32(10.0), gate, y))
        np.multiply(y, up, out=out)

    def scale(self, x: np.ndarray, s: float) -> None:
        x *= F32(s)


def softmax_total(e: np.ndarray) -> np.ndarray:
    """float64 (..., 1): sum over the last axis as ggml's softmax takes it: chunks of 8 summed in
    float32 in hsum_float_8's order ((4+0) + (6+2)) + ((5+1) + (7+3)), the chunks added in float64."""
    pad = (-e.shape[-1]) % 8
    c = np.concatenate([e, np.zeros(e.shape[:-1] + (pad,), F32)], axis=-1).reshape(*e.shape[:-1], -1, 8)
    r = [(c[..., i + 4] + c[..., i]).astype(F32) for i in range(4)]
    chunks = ((r[0] + r[2]).astype(F32) + (r[1] + r[3]).astype(F32)).astype(F32)
    total = np.zeros(e.shape[:-1], np.float64)
    for k in range(chunks.shape[-1]):  # in chunk order, as ggml accumulates
        total += chunks[..., k]
    return total[..., None]


def _fma(a, b, c):
    """float32 a * b + c rounded once (the product is exact in float64)."""
    return (a.astype(np.float64) * b + c).astype(F32)


def expf_ggml(x: np.ndarray) -> np.ndarray:
    """float32 exp(x) as ggml's vectorized x86 code computes it (kernels.cpu.common.expf_ggml, in
    NumPy): range reduction to n = round(x / ln 2), a degree-5 polynomial, 2^n by exponent bits."""
    x = np.asarray(x, dtype=F32)
    c = [F32(float.fromhex(h)) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3",
                                          "0x1.fffdb6p-2", "0x1.ffffecp-1")]
    r = F32(float.fromhex("0x1.8p23"))
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        z = _fma(x, F32(float.fromhex("0x1.715476p+0")), r)
        n = z - r
        b = _fma(-n, F32(float.fromhex("0x1.7f7d1cp-20")), _fma(-n, F32(float.fromhex("0x1.62e4p-1")), x))
        e = z.view(np.uint32) << np.uint32(23)
        k = (e + np.uint32(0x3F800000)).view(F32)
        u = b * b
        j = _fma(_fma(_fma(c[0], b, c[1]), u, _fma(c[2], b, c[3])), u, c[4] * b)
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0))
        s1 = (g + np.uint32(0x7F000000)).view(F32)
        s2 = (e - g).view(F32)
        big = np.abs(n) > F32(126.0)
        out = np.where(big, _fma(s2, j, s2) * s1, _fma(j, k, k))
        return np.where(np.abs(n) > F32(192.0), s1 * s1, out).astype(F32)


@functools.lru_cache(maxsize=1)
def gelu_f16_table() -> np.ndarray:
    """float32 (65536,): ggml's GELU table, GELU-tanh of every f16 value computed in float32 as
    ggml's compiled code does (kernels.cpu.ops.gelu_table) and stored as f16 (read-only)."""
    from edgellm.kernels import cpu

    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
    with np.errstate(invalid="ignore", over="ignore"):
        cpu._import("ops").gelu_table(x)
        table = x.astype(np.float16).astype(F32)
    table.flags.writeable = False
    return table


class RopeTables:
    """cos, sin float32 (n_pos, n_rot/2) per (n_rot, freq_base, freq_scale), built once with
    `rope_cache` for positions 0..n_pos-1 (a row depends only on its position, so indexing the
    table gives the same numbers as building it for the batch) and regrown by doubling."""

    def __init__(self):
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.factors: np.ndarray | None = None  # per pair: the angle is divided by it (rope_cache)
        self.mscale = F32(1.0)

    def set_factors(self, factors, mscale: float = 1.0) -> None:
        self.factors = None if factors is None else np.array(factors, dtype=F32).reshape(-1)
        self.mscale = F32(mscale)
        self._tables.clear()

    def get(self, n_rot: int, freq_base: float, freq_scale: float, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        key = (n_rot, float(freq_base), float(freq_scale))
        t = self._tables.get(key)
        if t is None or t[0].shape[0] < n_pos:
            size = max(1024, 1 << (max(n_pos, 1) - 1).bit_length())
            t = self._tables[key] = rope_cache(np.arange(size, dtype=np.int64), n_rot, freq_base, freq_scale,
                                               self.factors, self.mscale)
        return t


def rope_cache(pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float, factors=None,
               mscale=F32(1.0)) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 (n_tok, n_rot/2); theta built like ggml: theta_0 = p, theta_{i+1} =
    theta_i * base^(-2/n_rot) in float32, divided by factors[i] (when given), then times
    freq_scale; cos and sin from the C library's cosf / sinf, as ggml's rope cache takes them
    (NumPy's own float32 cos differs by an ulp), times mscale when it is not 1."""
    theta_scale = F32(freq_base ** (-2.0 / n_rot))
    theta = pos.astype(F32)
    out = np.empty((len(pos), n_rot // 2), dtype=F32)
    for i in range(n_rot // 2):
        out[:, i] = theta if factors is None else theta / factors[i]
        theta = theta * theta_scale
    out *= F32(freq_scale)
    from edgellm.kernels import cpu

    cos, sin = np.empty_like(out), np.empty_like(out)
    cpu._import("ops").cos_sin(out, cos, sin)
    if mscale != 1.0:
        cos *= F32(mscale)
        sin *= F32(mscale)
    return cos, sin
