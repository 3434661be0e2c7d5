"""GPU backend: the ops model code calls (the interface: edgellm.backend.Backend), on CuPy arrays.

Weight matrices are uploaded once as their raw GGUF blocks, uint8 (n_rows, row_bytes), and stay
quantized in VRAM. Products with quantized weights first quantize the activations to 8-bit blocks in
the CPU backend's format for the weight type (quant_act.cu: q8_32 for the legacy types, q8_k for the
K-quants), so GPU and CPU layers compute the same products up to float32 summation order. `linear`
runs a matrix-vector kernel with integer dot products (__dp4a) when there are few tokens (decode);
for a prompt batch it takes the 8-bit activations back to float32 (d * q, as the CPU's prompt path
does), dequantizes the matrix into one reused float32 buffer of at most DEQUANT_BUFFER_BYTES (a larger
matrix, such as a 262144-row output head, a slice of rows at a time) and calls cupy.matmul (cuBLAS).
Activations are float32; the KV cache is float16 by default. A block-quantized cache (q8_0 / q4_0) is
written by kv_quant.cu in the CPU backend's bytes; attention dequantizes each sequence's keys and
values to float32 (the dequantize kernels of those weight types), then runs the float32 attention
kernel (the CPU follows llama.cpp's flash-attention order instead: the query through 8 bits, integer
block dot products; the two agree to rounding, not bit for bit).

CuPy is imported when a CudaBackend is made, never when this module is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.backend import Backend, QMatrix, RingKV, attention_layout
from edgellm.errors import InvalidArgumentError, OutOfMemoryError, UnsupportedTensorTypeError
from edgellm.kernels import cuda as _cuda
from edgellm.quants import CPU_ONLY_TYPES, quant_type

F32 = np.float32
MATVEC_ROWS = 4  # warps (rows) per thread block of a matvec kernel
MATVEC_MAX_TOKENS = 4  # up to this many tokens, linear runs the matvec kernel once per token row
ELEMENTWISE_THREADS = 256
NORM_THREADS = 256  # must match NORM_THREADS in norm_rope.cu
ATTN_THREADS = 8 * 32  # ATTN_WARPS * 32 in attention.cu
ATTN_MAX_HEAD_DIM = 256
# Largest float32 buffer a prompt product dequantizes into (rows of W at a time): without the bound a
# big output head would take n_vocab * n_embd * 4 bytes (671 MiB for Gemma-3's 262144 x 640) on top
# of the planned VRAM.
DEQUANT_BUFFER_BYTES = 32 << 20


@dataclass(frozen=True)
class QuantKernels:
    """Where a type's kernels live: module `module`.cu defines matvec_<suffix>, dequantize_<suffix>_f32
    and dequantize_<suffix>_f16 (see quant_kernels.cuh)."""

    module: str
    suffix: str
    chunks: int  # threads per block in the dequantize kernel's launch (Block::chunks)
    act: str | None = None  # the 8-bit activation format of matvec_q8_<suffix> (None: float types)


QUANT_KERNELS: dict[GGMLType, QuantKernels] = {
    GGMLType.F32: QuantKernels("quant_float", "f32", 1),
    GGMLType.F16: QuantKernels("quant_float", "f16", 1),
    GGMLType.BF16: QuantKernels("quant_float", "bf16", 1),
    GGMLType.Q4_0: QuantKernels("quant_legacy", "q4_0", 4, "q8_32"),
    GGMLType.Q4_1: QuantKernels("quant_legacy", "q4_1", 4, "q8_32"),
    GGMLType.Q5_0: QuantKernels("quant_legacy", "q5_0", 4, "q8_32"),
    GGMLType.Q5_1: QuantKernels("quant_legacy", "q5_1", 4, "q8_32"),
    GGMLType.Q8_0: QuantKernels("quant_legacy", "q8_0", 4, "q8_32"),
    GGMLType.Q2_K: QuantKernels("quant_k", "q2_k", 16, "q8_k"),
    GGMLType.Q3_K: QuantKernels("quant_k", "q3_k", 16, "q8_k"),
    GGMLType.Q4_K: QuantKernels("quant_k", "q4_k", 16, "q8_k"),
    GGMLType.Q5_K: QuantKernels("quant_k", "q5_k", 16, "q8_k"),
    GGMLType.Q6_K: QuantKernels("quant_k", "q6_k", 16, "q8_k"),
}
ACT_BLOCK = {"q8_32": 32, "q8_k": 256}  # values per activation block
Q8_1_WEIGHTS = (GGMLType.Q4_1, GGMLType.Q5_1)  # products add m_w * fp16(d_x * sum(q_x)) per block

# Every other kernel the backend launches: name -> module.
OP_KERNELS: dict[str, str] = {
    "quantize_q8_32_f32": "quant_act",
    "quantize_q8_k_f32": "quant_act",
    "rms_norm_f32": "norm_rope",
    "rope_f32": "norm_rope",
    "attention_f16kv": "attention",
    "attention_f32kv": "attention",
    "kv_store_q8_0": "kv_quant",
    "kv_store_q4_0": "kv_quant",
    "silu_mul_f32": "elementwise",
    "gelu_mul_f32": "elementwise",
    "add_f32": "elementwise",
    "add_row_f32": "elementwise",
    "scale_f32": "elementwise",
}


# Block-quantized KV cache types (edgellm/kv_cache.py KV_TYPES) -> the kernel that stores K or V in them.
KV_STORE_KERNELS: dict[GGMLType, str] = {GGMLType.Q8_0: "kv_store_q8_0", GGMLType.Q4_0: "kv_store_q4_0"}


def required_kernels() -> dict[str, list[str]]:
    """module -> the kernel names this backend launches from it (CI checks they all compile)."""
    out: dict[str, list[str]] = {}
    for k in QUANT_KERNELS.values():
        out.setdefault(k.module, []).extend(
            [f"matvec_{k.suffix}", f"dequantize_{k.suffix}_f32", f"dequantize_{k.suffix}_f16"])
        if k.act:
            out[k.module].append(f"matvec_q8_{k.suffix}")
    for name, module in OP_KERNELS.items():
        out.setdefault(module, []).append(name)
    return out


def _blocks(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


class CudaKVLayer(RingKV):
    """A RingKV whose k, v live in VRAM; `pos_device` mirrors the host `pos` (slot -> position) as int32."""

    def __init__(self, cp, size, n_kv_head, head_dim_k, head_dim_v, dtype, window=0):
        super().__init__(cp, size, n_kv_head, head_dim_k, head_dim_v, dtype, window)
        self.pos_device = cp.full(size, -1, dtype=cp.int32)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes + self.pos_device.nbytes)

    def clear(self) -> None:
        super().clear()
        self.pos_device.fill(-1)


class CudaBackend(Backend):
    """Backend ops on one CUDA device. Raises GPUUnavailableError when CuPy or the device is missing."""

    device = "gpu"

    def __init__(self, device_id: int = 0, *, matvec_max_tokens: int = MATVEC_MAX_TOKENS,
                 q8_activations: bool = True):
        self.cp = _cuda.require()
        self.xp = self.cp
        self.device_id = device_id
        self.cp.cuda.Device(device_id).use()
        self.matvec_max_tokens = matvec_max_tokens
        # False: products with quantized weights take float32 activations (the dequantizing matvec
        # kernels and a plain float matmul): closer to the exact product, further from the CPU's
        self.q8_activations = q8_activations
        self._functions: dict[str, object] = {}
        self._modules: dict[str, object] = {}
        self._dequant_buffer = None  # float32, flat; the largest matrix dequantized so far
        self._pinned = None  # (pinned memory, numpy uint8 view) staging for host <-> device copies
        self._constants: dict[int, tuple] = {}  # id(host constant) -> (it, its device copy)

    # --- kernels --------------------------------------------------------------------------------
    def _function(self, module: str, name: str):
        fn = self._functions.get(name)
        if fn is None:
            if module not in self._modules:
                self._modules[module] = _cuda.load_module(module)
            fn = self._modules[module].get_function(name)
            self._functions[name] = fn
        return fn

    def _launch(self, module: str, name: str, grid, block, args, shared_mem: int = 0) -> None:
        self._function(module, name)(grid, block, args, shared_mem=shared_mem)

    # --- memory ---------------------------------------------------------------------------------
    def weight(self, t):
        """Matrices: raw blocks uploaded once (QMatrix with a cupy uint8 (n_rows, row_bytes) data);
        vectors (norms, biases): float32 (n,) on the device."""
        if len(t.ne) != 1 and t.qtype.ggml_type not in QUANT_KERNELS:
            raise UnsupportedTensorTypeError(
                f"{t.name} is {t.qtype.name}, which has no CUDA kernels yet; run with --gpu-layers 0 "
                f"(gpu_layers=0) or requantize the file to a K-quant or legacy type")
        try:
            if len(t.ne) == 1:
                return self.cp.asarray(np.ascontiguousarray(t.as_float32().reshape(-1), dtype=F32))
            return QMatrix(int(t.qtype.ggml_type), self.cp.asarray(np.ascontiguousarray(t.data)), t.n_rows,
                           t.n_cols, t.name)
        except self.cp.cuda.memory.OutOfMemoryError as e:
            free, total = self.cp.cuda.runtime.memGetInfo()
            raise OutOfMemoryError(
                f"GPU out of memory uploading {t.name} ({t.nbytes / 2**20:.1f} MiB): {free / 2**20:.0f} MiB "
                f"free of {total / 2**20:.0f} MiB; use fewer --gpu-layers or a smaller quant type ({e})"
            ) from None

    def empty(self, shape, dtype=F32):
        return self.cp.empty(shape, dtype=dtype)

    def kv_layer(self, size, n_kv_head, head_dim_k, head_dim_v, dtype, window=0) -> CudaKVLayer:
        return CudaKVLayer(self.cp, size, n_kv_head, head_dim_k, head_dim_v, dtype, window)

    def _staging(self, nbytes: int) -> np.ndarray:
        """A pinned host buffer of at least nbytes, reused (grown when too small)."""
        if self._pinned is None or self._pinned[1].nbytes < nbytes:
            capacity = max(nbytes, 1 << 16)
            mem = self.cp.cuda.alloc_pinned_memory(capacity)
            self._pinned = (mem, np.frombuffer(mem, np.uint8, capacity))
        return self._pinned[1][:nbytes]

    def from_host(self, x: np.ndarray):
        """Host array -> device array, through pinned memory; returns once the copy is done."""
        x = np.ascontiguousarray(x)
        staged = self._staging(x.nbytes).view(x.dtype).reshape(x.shape)
        staged[...] = x
        a = self.cp.empty(x.shape, dtype=x.dtype)
        a.set(staged)
        self.cp.cuda.get_current_stream().synchronize()  # the staging buffer is reused next call
        return a

    def to_host(self, a) -> np.ndarray:
        """Device array -> new host array, through pinned memory."""
        a = self.cp.ascontiguousarray(a)
        staged = self._staging(a.nbytes).view(a.dtype).reshape(a.shape)
        a.get(out=staged)
        self.cp.cuda.get_current_stream().synchronize()
        return staged.copy()

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def constant(self, a: np.ndarray):
        """A read-only host constant uploaded once (the host array is kept, so its id stays its own)."""
        held = self._constants.get(id(a))
        if held is None:
            held = self._constants[id(a)] = (a, self.cp.asarray(a))
        return held[1]

    def record_event(self):
        """A CUDA event recorded on the current stream (GPU time = elapsed_ms(start, end))."""
        event = self.cp.cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start, end) -> float:
        end.synchronize()
        return float(self.cp.cuda.get_elapsed_time(start, end))

    def memory_used(self) -> int:
        """Bytes held by CuPy's memory pool on this device (weights, KV cache, scratch)."""
        return int(self.cp.get_default_memory_pool().total_bytes())

    # --- quantized products ---------------------------------------------------------------------
    def dequantize(self, w: QMatrix, out) -> None:
        """out float32 or float16 (n_rows, n_cols) = W dequantized."""
        k = QUANT_KERNELS[GGMLType(w.ggml_type)]
        dtype = "f16" if out.dtype == self.cp.float16 else "f32"
        n_rows, row_bytes = w.data.shape
        n_threads = n_rows * (w.n_cols // quant_type(w.ggml_type).block_size) * k.chunks
        self._launch(k.module, f"dequantize_{k.suffix}_{dtype}", (_blocks(n_threads, ELEMENTWISE_THREADS),),
                     (ELEMENTWISE_THREADS,), (w.data, out, np.int32(n_rows), np.int32(w.n_cols), np.int64(row_bytes)))

    def quantize_act(self, fmt: str, x, write_xr: bool = False):
        """x float32 (n_tok, n) -> (xq int8 (n_tok * n,), xd float32 (blocks,), xs int32, xm float32, xr):
        x in 8-bit activation blocks of format fmt ("q8_32" or "q8_k", see quant_act.cu); xr (n_tok, n) =
        d * q as float32 when write_xr, else None. For q8_k, xs holds 16 sums per block and xm is empty."""
        n = x.size
        block = ACT_BLOCK[fmt]
        if n % block:
            raise InvalidArgumentError(f"{fmt} activations need a multiple of {block} values, got {n}")
        x = self._contiguous(x)
        nb = n // block
        cp = self.cp
        xq, xd = cp.empty(n, dtype=cp.int8), cp.empty(nb, dtype=cp.float32)
        xs = cp.empty(nb * (16 if fmt == "q8_k" else 1), dtype=cp.int32)
        xm = cp.empty(nb if fmt == "q8_32" else 0, dtype=cp.float32)
        xr = cp.empty(x.shape, dtype=cp.float32) if write_xr else None
        xr_arg = xr if write_xr else xd  # any device pointer: the kernel does not touch it
        grid, block_dim = (_blocks(nb, MATVEC_ROWS),), (32, MATVEC_ROWS)
        if fmt == "q8_32":
            self._launch("quant_act", "quantize_q8_32_f32", grid, block_dim,
                         (x, xq, xd, xs, xm, xr_arg, np.int32(write_xr), np.int64(nb)))
        else:
            self._launch("quant_act", "quantize_q8_k_f32", grid, block_dim,
                         (x, xq, xd, xs, xr_arg, np.int32(write_xr), np.int64(nb)))
        return xq, xd, xs, xm, xr

    def matvec(self, w: QMatrix, x, out) -> None:
        """out (n_tok, n_rows) = x (n_tok, n_cols) @ W.T by a matvec kernel (one warp per row): with x
        quantized to 8 bits and integer dot products (matvec_q8_*) for quantized weights, else in float."""
        k = QUANT_KERNELS[GGMLType(w.ggml_type)]
        n_tok = x.shape[0]
        n_rows, row_bytes = w.data.shape
        grid, block = (_blocks(n_rows, MATVEC_ROWS), n_tok), (32, MATVEC_ROWS)
        if k.act and self.q8_activations:
            xq, xd, xs, xm, _ = self.quantize_act(k.act, x)
            self._launch(k.module, f"matvec_q8_{k.suffix}", grid, block,
                         (w.data, xq, xd, xs, xm if xm.size else xd, out, np.int32(n_rows), np.int32(w.n_cols),
                          np.int64(row_bytes)))
            return
        self._launch(k.module, f"matvec_{k.suffix}", grid, block,
                     (w.data, x, out, np.int32(n_rows), np.int32(w.n_cols), np.int64(row_bytes)))

    def _dense(self, w: QMatrix):
        """W as float32 (n_rows, n_cols): a view for F32 weights, else dequantized into the reused buffer."""
        if w.ggml_type == GGMLType.F32:
            return w.data.view(self.cp.float32).reshape(w.n_rows, w.n_cols)
        n = w.n_rows * w.n_cols
        if self._dequant_buffer is None or self._dequant_buffer.size < n:
            self._dequant_buffer = None  # free the old one before allocating the larger one
            self._dequant_buffer = self.cp.empty(n, dtype=self.cp.float32)
        dense = self._dequant_buffer[:n].reshape(w.n_rows, w.n_cols)
        self.dequantize(w, dense)
        return dense

    def linear(self, w: QMatrix, x, out) -> None:
        """out (n_tok, n_rows) = x (n_tok, n_cols) @ W.T"""
        _check_shape("linear x", x, (x.shape[0], w.n_cols))
        _check_shape("linear out", out, (x.shape[0], w.n_rows))
        self._require_contiguous("linear out", out)
        x = self._contiguous(x)
        if x.dtype != np.float32:
            raise InvalidArgumentError(f"linear: x must be float32, got {x.dtype}")
        if x.shape[0] <= self.matvec_max_tokens:
            self.matvec(w, x, out)
            return
        k = QUANT_KERNELS[GGMLType(w.ggml_type)]
        q8 = None
        if k.act and self.q8_activations:  # the CPU's prompt path: x through 8 bits and back (d * q)
            q8 = self.quantize_act(k.act, x, write_xr=True)
            x = q8[4]
        self._dense_product(w, x, out)
        if q8 is not None and w.ggml_type in Q8_1_WEIGHTS:
            # per block the CPU adds m_w * fp16(d_x * sum(q_x)); the float product gave m_w * fp16(d_x) * sum(q_x)
            _, xd, xs, xm, _ = q8
            error = (xm - xd * xs.astype(self.cp.float32)).reshape(x.shape[0], -1)  # (n_tok, n_blocks)
            out += self.cp.matmul(error, self._block_mins(w).T)

    def _block_mins(self, w: QMatrix):
        """float32 (n_rows, n_blocks): the f16 m (bytes 2..3) of every block of a Q4_1 / Q5_1 matrix."""
        n_rows, row_bytes = w.data.shape
        nb = w.n_cols // 32
        m = self.cp.ascontiguousarray(w.data.reshape(n_rows, nb, row_bytes // nb)[:, :, 2:4])
        return m.view(self.cp.float16).reshape(n_rows, nb).astype(self.cp.float32)

    def _dense_product(self, w: QMatrix, x, out) -> None:
        """out (n_tok, n_rows) = x @ W.T with W dequantized to float32 (slices of rows for a big W)."""
        rows = max(MATVEC_ROWS, DEQUANT_BUFFER_BYTES // (4 * w.n_cols))
        if w.ggml_type == GGMLType.F32 or rows >= w.n_rows:
            self.cp.matmul(x, self._dense(w).T, out=out)
            return
        for r0 in range(0, w.n_rows, rows):  # out (n_tok, n_rows): a column slice per slice of W's rows
            r1 = min(w.n_rows, r0 + rows)
            part = QMatrix(w.ggml_type, w.data[r0:r1], r1 - r0, w.n_cols, w.name)
            out[:, r0:r1] = self.cp.matmul(x, self._dense(part).T)

    def embed(self, w: QMatrix, ids: np.ndarray, out) -> None:
        """out (n_tok, n_embd) = rows `ids` of the embedding matrix, dequantized."""
        rows = w.data[self.cp.asarray(np.asarray(ids, dtype=np.int64))]
        self.dequantize(QMatrix(w.ggml_type, self.cp.ascontiguousarray(rows), len(ids), w.n_cols, w.name), out)

    # --- normalization, rotary embedding, attention ---------------------------------------------
    def rms_norm(self, x, w, eps: float, out) -> None:
        """Over the last axis: out = x / sqrt(mean(x^2) + eps) * w (w None: no weight). out may be x."""
        n = x.shape[-1]
        self._require_contiguous("rms_norm out", out)
        x2, out2 = self._contiguous(x).reshape(-1, n), out.reshape(-1, n)
        has_w = w is not None
        w_arg = w if has_w else x2  # any device pointer; the kernel does not read it
        if has_w and w.shape != (n,):
            raise InvalidArgumentError(f"rms_norm weight has shape {w.shape}, expected ({n},)")
        self._launch("norm_rope", "rms_norm_f32", (x2.shape[0],), (NORM_THREADS,),
                     (x2, w_arg, np.int32(has_w), out2, np.int32(n), F32(eps), np.int64(x2.strides[0] // 4),
                      np.int64(out2.strides[0] // 4)))

    _rope_factors = None  # float32 (n_rot/2,): set_rope_factors

    def set_rope_factors(self, factors, mscale: float = 1.0) -> None:
        if mscale != 1.0:
            from edgellm.errors import UnsupportedArchitectureError

            raise UnsupportedArchitectureError("RoPE with an attention factor (LongRoPE's attn_factor) is not on the GPU "
                                   "path yet; run this model on the CPU (--gpu-layers 0)")
        self._rope_factors = None if factors is None else np.asarray(factors, dtype=np.float32).reshape(-1)

    def rope(self, x, pos, n_rot: int, freq_base: float, freq_scale: float, neox: bool,
             freq_factors=None) -> None:
        """In place on x (n_tok, n_head, head_dim) at positions pos (n_tok,); see norm_rope.cu."""
        n_tok, n_head, head_dim = x.shape
        if x.strides[2] != 4 or x.dtype != self.cp.float32:
            raise InvalidArgumentError("rope needs float32 x with contiguous head dimensions")
        if n_rot % 2 or not 0 < n_rot <= head_dim:
            raise InvalidArgumentError(f"n_rot must be even and in 1..head_dim ({head_dim}), not {n_rot}")
        pos_d = self.cp.asarray(np.asarray(pos, dtype=np.int32) if isinstance(pos, np.ndarray) else pos,
                                dtype=self.cp.int32)
        theta_scale = F32(freq_base ** (-2.0 / n_rot))  # as kernels.cpu.numpy_backend.rope_cache computes it
        if freq_factors is None:
            freq_factors = self._rope_factors
        has_ff = freq_factors is not None
        ff = self.cp.asarray(freq_factors, dtype=self.cp.float32) if has_ff else pos_d
        threads = min(256, 32 * _blocks(n_rot // 2, 32))
        self._launch("norm_rope", "rope_f32", (n_tok, n_head), (threads,),
                     (x, pos_d, np.int32(n_rot), theta_scale, F32(freq_scale), np.int32(bool(neox)), ff,
                      np.int32(has_ff), np.int64(x.strides[0] // 4), np.int64(x.strides[1] // 4)))

    def kv_array(self, shape, dtype):
        """A paged KV cache array (edgellm/kv_cache.py) in VRAM."""
        return self.cp.zeros(shape, dtype=dtype)

    def kv_store(self, kv, k, v, pos: np.ndarray) -> None:
        """Write k (n_tok, n_kv_head, head_dim_k), v at positions pos into their slots (a ring's
        pos % size, or the paged cache's step layout)."""
        slots = kv.slots(np.asarray(pos))
        slots_d = self.cp.asarray(slots.astype(np.int64))
        quant = getattr(kv, "quant", None)
        if quant is not None:  # each head's values as one row of blocks, in the CPU's bytes
            self._kv_store_quantized(quant.ggml_type, kv.k, k, slots_d)
            self._kv_store_quantized(quant.ggml_type, kv.v, v, slots_d)
        else:
            kv.k[slots_d] = k.astype(kv.k.dtype, copy=False)  # rounded to nearest, like numpy's astype
            kv.v[slots_d] = v.astype(kv.v.dtype, copy=False)
        kv.pos[slots] = pos
        if isinstance(kv, CudaKVLayer):
            kv.pos_device[slots_d] = self.cp.asarray(np.asarray(pos, dtype=np.int32))
            kv.n_used = max(kv.n_used, int(slots.max()) + 1)

    def attention(self, q, kv, pos, scale: float, out) -> None:
        """Causal (and sliding-window) attention of q (n_tok, n_head, hd_k) at positions pos over the
        cache; out (n_tok, n_head * hd_v). See attention.cu. A paged cache's key lists are gathered
        per sequence into contiguous arrays for the kernel (a token alone, or a prompt chunk)."""
        if isinstance(kv, CudaKVLayer):
            return self._attend(q, kv.k, kv.v, kv.pos_device, kv.n_used, pos, kv.window, scale, out)
        kmap, kbeg, kend, n_single, chunks = attention_layout(kv, q.shape[0])
        quant = getattr(kv, "quant", None)
        for t0, t1 in [(t, t + 1) for t in range(n_single)] + list(chunks):
            keys = kmap[kbeg[t0]:kend[t0]]
            keys_d = self.cp.asarray(keys)
            kpos_d = self.cp.asarray(kv.pos[keys].astype(np.int32))
            k, v = kv.k[keys_d], kv.v[keys_d]
            if quant is not None:  # the blocks dequantized to float32, then the float32 kernel
                k, v = self._dequantize_rows(quant.ggml_type, k), self._dequantize_rows(quant.ggml_type, v)
            self._attend(q[t0:t1], k, v, kpos_d, len(keys), pos[t0:t1], kv.window, scale, out[t0:t1])

    def _kv_store_quantized(self, ggml_type: int, cache, x, slots_d) -> None:
        """cache uint8 (n_slots, n_kv_head, row_bytes) at slots_d (n_tok,) int64 = x (n_tok, n_kv_head,
        head_dim) float32 quantized to blocks of 32 (kv_quant.cu)."""
        name = KV_STORE_KERNELS.get(GGMLType(ggml_type))
        if name is None:
            raise InvalidArgumentError(f"a {GGMLType(ggml_type).name} KV cache is not supported on the GPU")
        n_tok, n_kv_head, head_dim = x.shape
        qt = quant_type(ggml_type)
        if head_dim % qt.block_size or cache.shape[1:] != (n_kv_head, head_dim // qt.block_size * qt.type_size):
            raise InvalidArgumentError(f"KV cache of shape {cache.shape} cannot hold {x.shape} in {qt.name} blocks")
        x = self._contiguous(x.astype(self.cp.float32, copy=False))
        blocks_per_tok = n_kv_head * head_dim // qt.block_size
        n_blocks = n_tok * blocks_per_tok
        self._launch("kv_quant", name, (_blocks(n_blocks, MATVEC_ROWS),), (32, MATVEC_ROWS),
                     (x, cache, slots_d, np.int64(blocks_per_tok), np.int64(n_blocks)))

    def _dequantize_rows(self, ggml_type: int, blocks):
        """blocks uint8 (T, n_kv_head, row_bytes) of a quantized cache -> float32 (T, n_kv_head, head_dim)."""
        n, n_kv_head, row_bytes = blocks.shape
        qt = quant_type(ggml_type)
        head_dim = row_bytes // qt.type_size * qt.block_size
        out = self.cp.empty((n, n_kv_head, head_dim), dtype=self.cp.float32)
        rows = self.cp.ascontiguousarray(blocks).reshape(n * n_kv_head, row_bytes)
        self.dequantize(QMatrix(ggml_type, rows, n * n_kv_head, head_dim), out.reshape(n * n_kv_head, head_dim))
        return out

    def _attend(self, q, k, v, kpos_d, used: int, pos, window: int, scale: float, out) -> None:
        n_tok, n_head, hd_k = q.shape
        n_kv_head, hd_v = k.shape[1], v.shape[2]
        if n_head % n_kv_head:
            raise InvalidArgumentError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv_head}")
        if max(hd_k, hd_v) > ATTN_MAX_HEAD_DIM:
            raise InvalidArgumentError(f"head_dim {max(hd_k, hd_v)} > {ATTN_MAX_HEAD_DIM} is not supported on the GPU")
        _check_shape("attention out", out, (n_tok, n_head * hd_v))
        self._require_contiguous("attention out", out)
        if k.dtype == self.cp.float16:
            name = "attention_f16kv"
        elif k.dtype == self.cp.float32:
            name = "attention_f32kv"
        else:
            raise InvalidArgumentError(f"KV cache dtype {k.dtype} is not supported on the GPU (f16, f32)")
        q = self._contiguous(q)
        pos_d = self.cp.asarray(np.asarray(pos, dtype=np.int32))
        self._launch("attention", name, (n_head, n_tok), (ATTN_THREADS,),
                     (q, pos_d, k, v, kpos_d, np.int32(used), out, np.int32(n_head),
                      np.int32(n_kv_head), np.int32(hd_k), np.int32(hd_v), F32(scale), np.int32(window or 0)))

    # --- element-wise ---------------------------------------------------------------------------
    def _elementwise(self, name: str, args_arrays, out, *scalars) -> None:
        n = out.size
        for a in (*args_arrays, out):
            self._require_contiguous(name, a)
            if a.size != n:
                raise InvalidArgumentError(f"{name}: operands have {a.size} and {n} elements")
        self._launch("elementwise", name, (_blocks(n, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                     (*args_arrays, out, *scalars, np.int64(n)))

    def silu_mul(self, gate, up, out) -> None:
        """out = silu(gate) * up"""
        self._elementwise("silu_mul_f32", (gate, up), out)

    def gelu_mul(self, gate, up, out) -> None:
        """out = gelu_tanh(gate) * up"""
        self._elementwise("gelu_mul_f32", (gate, up), out)

    def add(self, x, y, out) -> None:
        """out = x + y; y may be broadcast over the leading axes of x (a bias: (n,) over (n_tok, n), or
        (n_head, head_dim) over (n_tok, n_head, head_dim) as qkv_attention_by_ops passes it)."""
        if y.size == x.size:
            self._elementwise("add_f32", (x, y), out)
            return
        n = y.size
        if not 0 < y.ndim < x.ndim or tuple(x.shape[x.ndim - y.ndim:]) != tuple(y.shape):
            raise InvalidArgumentError(f"add: cannot broadcast {y.shape} over {x.shape}")
        for a in (x, y, out):
            self._require_contiguous("add", a)
        self._launch("elementwise", "add_row_f32", (_blocks(x.size, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                     (x, y, out, np.int64(x.size), np.int32(n)))

    def scale(self, x, s: float) -> None:
        """x *= s in place."""
        self._require_contiguous("scale", x)
        self._launch("elementwise", "scale_f32", (_blocks(x.size, ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                     (x, F32(s), np.int64(x.size)))

    # --- helpers --------------------------------------------------------------------------------
    def _contiguous(self, a):
        return a if a.flags.c_contiguous else self.cp.ascontiguousarray(a)

    @staticmethod
    def _require_contiguous(name: str, a) -> None:
        if not a.flags.c_contiguous:
            raise InvalidArgumentError(f"{name}: the GPU kernels need C-contiguous arrays")
        if a.dtype != np.float32:
            raise InvalidArgumentError(f"{name}: the GPU kernels need float32 arrays, got {a.dtype}")


def _check_shape(name: str, a, shape) -> None:
    if tuple(a.shape) != tuple(shape):
        raise InvalidArgumentError(f"{name} has shape {tuple(a.shape)}, expected {tuple(shape)}")


__all__ = ["CPU_ONLY_TYPES", "CudaBackend", "CudaKVLayer", "KV_STORE_KERNELS", "QUANT_KERNELS", "OP_KERNELS", "required_kernels"]
