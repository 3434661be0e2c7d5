"""The backend interface: the ops model code (models/decoder.py), the runtime and the KV cache call
on a device, and the values they pass.

A backend binds the ops to one device at load: `edgellm.kernels.cpu.backend.CPUBackend` (Numba
kernels; `NumpyBackend` is its plain-NumPy twin), `edgellm.backend_reference.ReferenceBackend`
(everything dequantized to float32) and `edgellm.kernels.cuda.backend.CudaBackend` (CuPy). Model code
never asks which one it has, nor which quant type a weight is.

Arrays are the backend's own (NumPy on the CPU, CuPy on the GPU); activations are float32, rows
first: x (n_tok, n_embd). Every op writes into an out-parameter or works in place; none allocates
except `empty`, `kv_array`, `kv_layer`, `weight` and the host crossings.

    QMatrix        a weight matrix in its quantized blocks
    KVLayer        one layer's K/V cache: a RingKV (one sequence: warm-up, kernel tests) or the paged
                   cache's layer (edgellm.kv_cache.PagedKV)
    Backend        the ops; the fused ones default to their primitive-op versions
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

F32 = np.float32


# ============================================================================ values
@dataclass(frozen=True)
class QMatrix:
    """A weight matrix kept in its quantized blocks: W (n_rows, n_cols) of type ggml_type, stored as
    data uint8 (n_rows, row_bytes) (row_bytes = n_cols / block size * type size): a read-only view
    of the mapped file on the CPU, the uploaded blocks on the GPU (a CuPy array)."""

    ggml_type: int
    data: np.ndarray
    n_rows: int
    n_cols: int
    name: str = ""  # the GGUF tensor name, for messages

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


class KVLayer:
    """One layer's K and V cache on the layer's device: k, v (slots, n_kv_head, head_dim), `pos[slot]`
    the position a slot holds (-1: empty), `window` (0: none), `quant` (a block-quantized KVType: k,
    v hold each head's row of ggml blocks; None: float), and `layout`, which says where a step's
    tokens are written and what they attend to. Two kinds, taken alike by every op: RingKV (one
    sequence) and the paged cache's layer (edgellm.kv_cache.PagedKV)."""

    quant = None

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def kernel_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """k, v as the Numba kernels take them: float16 caches as their uint16 bits (views)."""
        if getattr(self, "_kernel_arrays", None) is None:
            bits = self.k.dtype == np.float16
            self._kernel_arrays = (self.k.view(np.uint16), self.v.view(np.uint16)) if bits else (self.k, self.v)
        return self._kernel_arrays


class RingKV(KVLayer):
    """A KVLayer for one sequence, as a ring: size slots; a token at position p lives in slot
    p % size, so a sliding-window layer needs only window + n_batch slots."""

    def __init__(self, xp, size: int, n_kv_head: int, head_dim_k: int, head_dim_v: int, dtype, window: int = 0):
        self.size = size
        self.window = window
        self.k = xp.zeros((size, n_kv_head, head_dim_k), dtype=dtype)
        self.v = xp.zeros((size, n_kv_head, head_dim_v), dtype=dtype)
        if xp is np:  # commit the pages now (zeros() maps them lazily): memory runs out at load,
            self.k.fill(0)  # never in the middle of a generation
            self.v.fill(0)
        self.pos = np.full(size, -1, dtype=np.int64)  # host-side bookkeeping
        self.n_used = 0  # slots [0, n_used) may hold data
        self.singles = 0  # a warm-up's mixed step: its first `singles` tokens take the one-token kernel

    def clear(self) -> None:
        self.pos[:] = -1
        self.n_used = 0

    def slots(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.size

    @property
    def layout(self):
        """The ring as a one-sequence step layout: every query sees slots [0, n_used), one token
        alone (the one-token kernel), a batch as one chunk."""
        return _RingLayout(self)


class _RingLayout:
    """kv_cache.StepLayout's fields for a RingKV (computed when read: n_used changes)."""

    def __init__(self, kv: RingKV):
        self.kv = kv

    def for_tokens(self, n_tok: int):
        used = self.kv.n_used
        kmap = np.arange(used, dtype=np.int64)
        kbeg, kend = np.zeros(n_tok, np.int64), np.full(n_tok, used, np.int64)
        alone = 1 if n_tok == 1 else min(self.kv.singles, n_tok - 1)
        return kmap, kbeg, kend, alone, ([] if n_tok == 1 else [(alone, n_tok)])


def attention_layout(kv, n_tok: int):
    """(kmap, kbeg, kend, n_single, chunks) of a step over cache layer kv (see kv_cache.StepLayout):
    token t attends to slots kmap[kbeg[t]:kend[t]]; the first n_single tokens each alone, then each
    (t0, t1) of chunks together."""
    lay = kv.layout
    if isinstance(lay, _RingLayout):
        return lay.for_tokens(n_tok)
    return lay.kmap, lay.kbeg, lay.kend, lay.n_single, lay.chunks


# ============================================================================ the ops
class Backend(ABC):
    """The ops of one device. `kv` arguments are a KVLayer (a RingKV or a kv_cache.PagedKV) on this device;
    `pos` is host int64 (n_tok,), each token's position in its sequence."""

    device: str = "cpu"  # "cpu" | "gpu": the key of this backend in the runtime's and the ledger's maps
    # decode_block(L, x, pos, kv, s, *, eps, n_rot, freq_base, freq_scale, neox, scale, gelu, q_scale)
    #   -> bool: decode tokens of up to ALONE_MAX sequences (one each) through a whole block (x (n, n_embd) in
    #   place, s the decoder's scratch) in one call, each with the bits it gets alone; False, having
    #   done nothing, when it cannot take this block. None: not offered (the decoder runs the block
    #   op by op).
    decode_block = None
    # decode_layers(blocks, x, pos, kvs, s, *, ropes, eps, n_rot, neox, scale, gelu, q_scale) -> bool: the
    #   same for several blocks in order (a whole model's, kvs / ropes per block) in one call; the runtime
    #   offers it when every layer is on this backend. None: not offered.
    decode_layers = None

    def set_rope_factors(self, factors, mscale: float = 1.0) -> None:
        """Every later `rope` of this backend divides each pair's angle by factors[i] (float32
        (n_rot/2,), a file's rope_freqs / LongRoPE factors; None: none) and scales cos and sin by
        mscale, as ggml's rope cache does. Default: refused (a backend without them)."""
        if factors is not None or mscale != 1.0:
            from edgellm.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(f"the {self.device} backend has no RoPE frequency factors")

    def set_attn_softcap(self, cap: float) -> None:
        """Every later attention caps its raw scores: cap * tanh(score / cap) before the scale
        (Gemma-2). Default: refused (a backend without it)."""
        if cap:
            from edgellm.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError(f"the {self.device} backend has no attention soft cap (gemma2) "
                                               "yet; run this model on the CPU (--gpu-layers 0)")

    def run(self, fn, *args):
        """fn(*args), run where this backend's kernels run best: the runtime's steps and warm-up go
        through the CPU backend's run (its kernels' thread, with its thread count). Default: here."""
        return fn(*args)

    def prepare(self, model, cfg, layer_devices, output_device: str, n_seq: int, kv_dtype, *,
                on_compile=None) -> None:
        """Called once when a runtime is built, before any weight is read: the backend may load (or
        compile) the kernels the steps will run. on_compile(kernel_name), if given, hears of each
        kernel that starts compiling. Default: nothing."""

    def after_step(self, shape: tuple) -> None:
        """Called after every forward step, shape = (entries, tokens): the backend may hand back
        memory its step used to load kernels. Default: nothing."""

    def make_resident(self, model) -> None:
        """Called once after the warm-up: the backend may move the weights of its layers (model:
        the Decoder) to where its kernels read them fastest. Default: nothing."""

    # --- memory and the host ----------------------------------------------------------------------
    @abstractmethod
    def weight(self, t):
        """A tensor (gguf_file.TensorInfo) placed on this device: a matrix as a QMatrix (CPU: the
        mapped file's view; GPU: uploaded once; the reference backend: float32 (n_rows, n_cols)),
        a vector (norm, bias) as float32 (n,)."""

    @abstractmethod
    def empty(self, shape, dtype=F32):
        """An uninitialised device array (the decoder's scratch)."""

    @abstractmethod
    def from_host(self, x: np.ndarray):
        """Host array -> device array (a crossing of the hidden state)."""

    @abstractmethod
    def to_host(self, a) -> np.ndarray:
        """Device array -> host array."""

    def constant(self, a: np.ndarray):
        """A read-only host constant (a rotation matrix) as an array of this device. Default: a itself
        (a host backend); a device backend uploads it once and keeps the copy."""
        return a

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until every op issued so far has finished (device timing)."""

    @abstractmethod
    def kv_array(self, shape, dtype):
        """A paged KV cache array, zeros (n_slots, n_kv_head, head_dim or row bytes), its memory
        committed now (it runs out at load, never in the middle of a generation)."""

    @abstractmethod
    def kv_layer(self, size, n_kv_head, head_dim_k, head_dim_v, dtype, window=0) -> RingKV:
        """A one-sequence ring cache layer (the warm-up's scratch cache, kernel tests)."""

    # --- primitive ops ----------------------------------------------------------------------------
    @abstractmethod
    def embed(self, w, ids: np.ndarray, out) -> None:
        """out (n_tok, n_embd) = rows `ids` (int64 (n_tok,)) of the embedding matrix, dequantized."""

    @abstractmethod
    def linear(self, w, x, out) -> None:
        """out (n_tok, n_rows) = x (n_tok, n_cols) @ W.T"""

    @abstractmethod
    def add(self, x, y, out) -> None:
        """out = x + y; y may be a vector broadcast over the rows (a bias). out may be x."""

    @abstractmethod
    def rms_norm(self, x, w, eps: float, out) -> None:
        """Over the last axis of x (..., n): out = x / sqrt(mean(x^2) + eps) * w (w (n,) or None).
        Also QK-norm per head: x (n_tok, n_head, head_dim). out may be x."""

    @abstractmethod
    def rope(self, x, pos: np.ndarray, n_rot: int, freq_base: float, freq_scale: float, neox: bool) -> None:
        """Rotary position embedding in place on x (n_tok, n_head, head_dim); neox rotates pairs
        (i, i + n_rot/2), otherwise (2i, 2i+1)."""

    @abstractmethod
    def kv_store(self, kv, k, v, pos: np.ndarray) -> None:
        """k (n_tok, n_kv_head, head_dim_k) and v (n_tok, n_kv_head, head_dim_v) into the slots of
        kv for positions pos (kv.slots(pos))."""

    @abstractmethod
    def attention(self, q, kv, pos: np.ndarray, scale: float, out) -> None:
        """Causal (and sliding-window) attention of q (n_tok, n_head, head_dim_k) over the cache,
        each token over its own key list (the step layout: `attention_layout`); scores times
        `scale`; out (n_tok, n_head * head_dim_v)."""

    @abstractmethod
    def silu_mul(self, gate, up, out) -> None:
        """out = silu(gate) * up; (n_tok, n_ff). out may be gate."""

    @abstractmethod
    def gelu_mul(self, gate, up, out) -> None:
        """out = gelu_tanh(gate) * up; (n_tok, n_ff). out may be gate."""

    # --- fused ops (a backend may run these in fewer kernel calls; the same numbers) --------------
    def linear_many(self, ws, x, outs) -> None:
        """outs[i] = x @ ws[i].T for matrices sharing their input (q/k/v, gate/up)."""
        for w, out in zip(ws, outs):
            self.linear(w, x, out)

    def moe_decode(self, experts, ids, h, out) -> bool:
        """One token through several experts in fewer kernel calls: out (k, n_embd) = the SwiGLU FFN
        of h (1, n_embd) through expert ids[j] in row j, experts = (gate, up, down) lists of
        matrices; the bits of the products one by one. False (nothing done) where the backend has
        no such path for these weights."""
        return False

    def linear_rows(self, ws, x, outs) -> None:
        """outs[i] = x @ ws[i].T with every row of x alone: each row gets the bits a one-token product
        gives it (llama.cpp's MUL_MAT_ID rows for the types it runs one token at a time)."""
        for r in range(x.shape[0]):
            self.linear_many(ws, x[r:r + 1], [o[r:r + 1] for o in outs])

    def add_rms_norm(self, x, o, post_w, next_w, eps: float, h) -> None:
        """Residual step: o = rms_norm(o) * post_w (if given); x += o; h = rms_norm(x) * next_w
        (if given). x, o, h (n_tok, n_embd)."""
        if post_w is not None:
            self.rms_norm(o, post_w, eps, o)
        self.add(x, o, x)
        if next_w is not None:
            self.rms_norm(x, next_w, eps, h)

    def qkv_attention(self, q, k, v, *, biases, q_norm, k_norm, eps, n_rot, freq_base, freq_scale, neox,
                      kv, pos, scale, out, q_scale=1.0) -> None:
        """From the q, k, v projections to the attention output: + biases, QK-norm, RoPE,
        q * q_scale, k and v into the cache, attention. q (n_tok, n_head, hd_k), k (n_tok, n_kv, hd_k),
        v (n_tok, n_kv, hd_v), all changed in place; biases (bq, bk, bv) and the norms may be None;
        out (n_tok, n_head * hd_v)."""
        qkv_attention_by_ops(self, q, k, v, biases, q_norm, k_norm, eps, n_rot, freq_base, freq_scale, neox,
                             kv, pos, scale, out, q_scale)


def qkv_attention_by_ops(b, q, k, v, biases, q_norm, k_norm, eps, n_rot, freq_base, freq_scale, neox, kv, pos,
                         scale, out, q_scale=1.0) -> None:
    """`qkv_attention` as a sequence of the primitive backend ops (any backend; q * q_scale is
    an in-place array product, which NumPy and CuPy arrays both take)."""
    for x, bias in zip((q, k, v), biases):
        if bias is not None:
            b.add(x, bias.reshape(x.shape[1:]), x)
    if q_norm is not None:
        b.rms_norm(q, q_norm, eps, q)
    if k_norm is not None:
        b.rms_norm(k, k_norm, eps, k)
    b.rope(q, pos, n_rot, freq_base, freq_scale, neox)
    b.rope(k, pos, n_rot, freq_base, freq_scale, neox)
    if q_scale != 1.0:
        q *= np.float32(q_scale)
    quant = getattr(kv, "quant", None)
    rot_k = _rotation(b, rotation_size(k.shape[-1], widest=True)) if quant is not None else None
    rot_v = _rotation(b, rotation_size(v.shape[-1], widest=False)) if quant is not None else None
    if rot_k is not None:  # a block-quantized cache: q and k rotated alike, so q . k is unchanged
        rotate(q, rot_k)
        rotate(k, rot_k)
    if rot_v is not None:
        rotate(v, rot_v)
    b.kv_store(kv, k, v, pos)
    b.attention(q, kv, pos, scale, out)
    if rot_v is not None:  # the output is a sum of rotated values: rotate it back (H H = I)
        rotate(out.reshape(out.shape[0], -1, v.shape[-1]), rot_v)


# Before a block-quantized cache stores K and V, llama.cpp rotates q and k (and v, rotating the
# attention output back) by an orthonormal Walsh-Hadamard matrix, which spreads outlier values over
# the block and makes the 4/8-bit blocks far more accurate (docs/performance.md, standing decisions).
# Size: K the largest power of two >= 64 dividing head_dim, V 64; none when head_dim % 64 != 0.
def rotation_size(head_dim: int, widest: bool) -> int:
    if head_dim % 64:
        return 0
    n = 64
    while widest and head_dim % (2 * n) == 0:
        n *= 2
    return n


def _rotation(b, n: int):
    """hadamard(n) as backend b's array (None for n = 0)."""
    h = hadamard(n)
    return None if h is None else b.constant(h)


@functools.lru_cache(maxsize=8)
def hadamard(n: int) -> np.ndarray | None:
    """float32 (n, n) orthonormal Walsh-Hadamard matrix (Sylvester's construction: symmetric, H H = I);
    None for n = 0."""
    if n == 0:
        return None
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(n)).astype(F32)
    h.flags.writeable = False
    return h


def rotate(x: np.ndarray, h: np.ndarray) -> None:
    """In place: each run of len(h) values along x's last axis times h (hadamard(len(h))).

    On the host, as llama.cpp's CPU backend computes it (ggml_compute_forward_fwht, which its
    Hadamard products take): the values times 1 / sqrtf(n) in float32, then the fast Walsh-Hadamard
    butterflies (u + v, u - v) in float32, pass by pass, so the bits are llama.cpp's and do not
    depend on a BLAS's order or thread count (a float32 BLAS product made a q8_0-cache run give other
    logits with 1 thread than with 2). On a device, the product summed in float64 and rounded once."""
    n = h.shape[0]
    if not isinstance(x, np.ndarray):
        flat = x.reshape(-1, n)
        flat[:] = flat.astype(np.float64) @ h.astype(np.float64)
        return
    y = x.reshape(-1, n) * F32(1.0 / np.sqrt(F32(n)))
    length = 1
    while length < n:
        pairs = y.reshape(y.shape[0], n // (2 * length), 2, length)
        u, v = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = np.stack((u + v, u - v), axis=2).reshape(-1, n)
        length *= 2
    x.reshape(-1, n)[:] = y
