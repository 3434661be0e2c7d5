"""Numba CPU kernels for the GGML tensor types: dequantize, matvec (decode), matmul (prompt batches).

```python
from edgellm.kernels import cpu
cpu.dequantize(ggml_type, raw, out)   # raw uint8 (n_rows, row_bytes), out float32 (n_rows, n_cols)
cpu.matvec(ggml_type, raw, x, out)    # x float32 (n_cols,), out float32 (n_rows,): out = W @ x
cpu.matmul(ggml_type, raw, x, out)    # x float32 (n_tok, n_cols), out (n_tok, n_rows): x @ W.T
cpu.supported_types() -> list[GGMLType]
cpu.set_threads(n)                    # threads of the kernels and of NumPy's BLAS

m = cpu.bind(ggml_type, raw)          # checked once; m.matvec / m.matmul / m.dequantize cost a
m.matvec(x, out)                      #   few microseconds of Python per call
xa = cpu.quantize(m.act_format, x)    # x in llama.cpp's activation format for m's type ...
m.matvec_act(xa, out)                 # ... reused by every matrix with the same act_format
cpu.matvec_many([mq, mk, mv], x, [oq, ok, ov])   # x converted once per distinct format
```
Products use x exactly as llama.cpp's CPU backend converts it for the weight type (8-bit blocks
with fp16 scales, Q8_K, F16 / BF16 rounding; see common.py), in matvec and matmul alike, so the
numbers match llama.cpp's up to float32 summation order. `raw` may be a read-only memmap view of
a GGUF file; it is never copied. The kernels of a type family (dense, legacy, kquants, iquants, igrid) are
imported, and compiled, on the first call that needs them, so importing this package does not
import Numba. Compiled code is cached on disk under the user cache dir (NUMBA_CACHE_DIR, unless
the user set it).
"""
from __future__ import annotations

from importlib import import_module

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.errors import InvalidArgumentError
from edgellm.kernels.cpu.jit import (compile_listener, compiler_resident_bytes, loaded_kernels,  # noqa: F401
                                     numba_cache_dir, release_compiler, set_threads, use_cache_dir)
from edgellm.kernels.cpu.tensor_types import ACT_BLOCK, Q8_1_WEIGHTS, TYPES
from edgellm.quants import quant_type

# GGMLType -> (module in this package holding its kernels as `KERNELS`, activation format)
_FAMILY = {t: (r.family, r.act) for t, r in TYPES.items()}

# matmul dequantizes this many weights per tile (8 MiB of float32) before handing it to BLAS.
_TILE_WEIGHTS = 1 << 21

_kernels: dict = {}  # GGMLType -> (dequantize, matvec) Numba kernels, filled on first use
_U8, _F32 = np.dtype(np.uint8), np.dtype(np.float32)
_QTYPES = {}  # GGMLType / int -> QuantType of the supported types (quant_type raises for others)
_common = None  # the common module, imported with the first kernel family


for _t in _FAMILY:
    _QTYPES[_t] = _QTYPES[int(_t)] = quant_type(_t)


def supported_types() -> list[GGMLType]:
    return list(_FAMILY)


def activation_format(ggml_type) -> str:
    """The format x is converted to for products with weights of this type (see common.py)."""
    return _FAMILY[quant_type(ggml_type).ggml_type][1]


def _import(name: str):
    """A module of this package, imported (and Numba's cache dir set) on first use."""
    global _common
    use_cache_dir()
    module = import_module(f"{__name__}.{name}")
    if _common is None:
        _common = import_module(f"{__name__}.common")
    return module


def _kernel_pair(ggml_type: GGMLType):
    pair = _kernels.get(ggml_type)
    if pair is None:
        family = _FAMILY[ggml_type][0]
        if family is None:
            _import("common")
            pair = (None, None)
        else:
            pair = _import(family).KERNELS[ggml_type]
        _kernels[ggml_type] = pair
    return pair


def _matmul_kernel(ggml_type: GGMLType):
    """The batched kernel of a type whose products follow llama.cpp's order (None: BLAS path)."""
    _kernel_pair(ggml_type)
    family = _FAMILY[ggml_type][0]
    return getattr(import_module(f"{__name__}.{family}"), "MATMUL", {}).get(ggml_type) if family else None


class Activation:
    """x (n,) converted to one activation format; pass to Matrix.matvec_act for every matrix
    whose act_format is this format. `parts` are the kernel arguments (see common.py)."""

    __slots__ = ("format", "n", "parts")

    def __init__(self, fmt: str, n: int, parts: tuple):
        self.format, self.n, self.parts = fmt, n, parts


def quantize(fmt: str, x: np.ndarray) -> Activation:
    """x float32 (n,) in activation format `fmt` ("q8_32", "q8_k", "f16", "bf16", "f32")."""
    if fmt not in ACT_BLOCK:
        raise InvalidArgumentError(f"unknown activation format {fmt!r}; use one of {list(ACT_BLOCK)}")
    n = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 1 else -1
    x = _floats("x", x, (n,))
    if n % ACT_BLOCK[fmt]:
        raise InvalidArgumentError(f"x of {n} values cannot be cut into {fmt} blocks of {ACT_BLOCK[fmt]}")
    if _common is None:
        _import("common")
    return _quantize(fmt, x)


def _quantize(fmt: str, x: np.ndarray, batch: bool = False) -> Activation:
    """x in format fmt; batch: x is a prompt batch's rows end to end (converted by all threads)."""
    n = x.shape[0]
    if fmt == "q8_32":
        parts = (np.empty(n, np.int8), np.empty(n >> 5, np.float32), np.empty(n >> 5, np.int32),
                 np.empty(n >> 5, np.float32))
        (_common.quantize_q8_32_batch if batch else _common.quantize_q8_32)(x, *parts)
    elif fmt == "q8_k":
        parts = (np.empty(n, np.int8), np.empty(n >> 8, np.float32), np.empty(n >> 4, np.int32),
                 np.empty(0, np.float32))
        (_common.quantize_q8_k_batch if batch else _common.quantize_q8_k)(x, *parts)
    elif fmt == "f32":
        parts = (x,)
    else:
        xr = np.empty(n, np.float32)
        (_common.quantize_f16 if fmt == "f16" else _common.quantize_bf16)(x, xr)
        parts = (xr,)
    return Activation(fmt, n, parts)


def _requantize_into(xa: Activation, x: np.ndarray) -> None:
    """Convert x into the buffers of an existing Activation of the same format and length."""
    fmt = xa.format
    if fmt == "q8_32":
        _common.quantize_q8_32(x, *xa.parts)
    elif fmt == "q8_k":
        _common.quantize_q8_k(x, *xa.parts)
    elif fmt == "f32":
        xa.parts = (x,)
    else:
        (_common.quantize_f16 if fmt == "f16" else _common.quantize_bf16)(x, xa.parts[0])


def requantize(fmt: str, x: np.ndarray) -> np.ndarray:
    """x float32 (n_tok, n): every row converted to `fmt` and back to float32 (what matmul
    multiplies); x itself for "f32"."""
    if fmt == "f32":
        return x
    if _common is None:
        _import("common")
    out = np.empty_like(x)
    getattr(_common, f"requantize_rows_{fmt}")(x, out)
    return out


# --- argument checks ------------------------------------------------------------------------
def _weights(qtype, raw, n_cols: int) -> np.ndarray:
    """raw as a read-only C-contiguous uint8 (n_rows, row_bytes) view (never a copy)."""
    if not isinstance(raw, np.ndarray):
        raw = np.asarray(raw)
    flags = raw.flags
    if (raw.dtype is not _U8 and raw.dtype != _U8) or raw.ndim != 2 or not flags.c_contiguous:
        raise InvalidArgumentError(
            f"{qtype.name} weights must be a C-contiguous uint8 array (n_rows, row_bytes); got "
            f"{raw.dtype} {raw.shape}, contiguous={raw.flags.c_contiguous}")
    if n_cols < 0 or n_cols % qtype.block_size or raw.shape[1] != qtype.row_bytes(n_cols):
        raise InvalidArgumentError(
            f"{qtype.name} rows of {n_cols} weights take {qtype.row_bytes(max(n_cols, 0))} bytes "
            f"(n_cols a multiple of {qtype.block_size}); the weights have {raw.shape[1]} per row")
    if not flags.writeable:
        return raw
    view = raw.view()
    view.flags.writeable = False  # one compiled variant for memmaps and in-memory arrays
    return view


def _floats(name: str, a, shape: tuple, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray) or (a.dtype is not _F32 and a.dtype != _F32) or a.shape != shape \
            or not a.flags.c_contiguous or (writable and not a.flags.writeable):
        what = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise InvalidArgumentError(
            f"{name} must be a {'writable ' if writable else ''}C-contiguous float32 array of "
            f"shape {shape}; got {what}")
    return a


# --- bound matrices -------------------------------------------------------------------------
def packs_by_eight(ggml_type, n_rows: int) -> bool:
    """Whether a matrix of this type and row count is packed by eight rows on the CPU (Matrix.pack:
    Q4_K with a multiple of 8 rows; the planner charges those copies)."""
    return ggml_type == GGMLType.Q4_K and n_rows > 0 and n_rows % 8 == 0


class Matrix:
    """A weight matrix checked once, with its compiled kernels: the per-call cost of products is
    a shape check and the kernel call. Build with `bind`."""

    __slots__ = ("ggml_type", "raw", "n_rows", "n_cols", "act_format", "packed", "weights", "_qtype", "_deq",
                 "_mv", "_mm", "_scratch", "_mins")

    def __init__(self, ggml_type, raw, n_cols: int | None = None):
        qtype = _QTYPES.get(ggml_type) or quant_type(ggml_type)  # raises for unknown ids
        if n_cols is None:
            raw_cols = raw.shape[1] if isinstance(raw, np.ndarray) and raw.ndim == 2 else 0
            n_cols = raw_cols // qtype.type_size * qtype.block_size
        self._qtype = qtype
        self.ggml_type = qtype.ggml_type
        self.raw = _weights(qtype, raw, n_cols)
        self.n_rows, self.n_cols = self.raw.shape[0], n_cols
        self.act_format = _FAMILY[self.ggml_type][1]
        if n_cols % ACT_BLOCK[self.act_format]:
            raise InvalidArgumentError(
                f"{qtype.name} rows of {n_cols} weights: products need a multiple of "
                f"{ACT_BLOCK[self.act_format]} columns")
        self._deq, self._mv = _kernel_pair(self.ggml_type)
        self._mm = _matmul_kernel(self.ggml_type)
        self.packed = None  # the rows packed by eight (Q4_K, after pack())
        self.weights = self.raw  # what the product kernels read: raw, or packed once packed
        self._scratch = None  # the Activation of matvec(x), reused call after call
        self._mins = None  # Q4_1 / Q5_1 block mins, for matmul's Q8_1 sum correction

    def pack(self, alloc=None) -> bool:
        """Q4_K with a multiple of 8 rows: the rows packed by eight (kquants.pack8_q4_k, a copy 37/36
        of raw's size, as llama.cpp repacks Q4_K at load), which matvec and matmul then read instead
        of raw: the same results bit for bit, each row a lane of the kernels' vectors (faster decode:
        docs/performance.md). alloc(shape) gives the uint8 array to pack into
        (default: a new NumPy array). True when packed; raw is not read by products after."""
        if self.packed is None:
            if not packs_by_eight(self.ggml_type, self.n_rows):
                return False
            kq = _import("kquants")
            out = None if alloc is None else alloc(kq.pack8_shape(self.raw.shape))
            self.packed = self.weights = kq.pack8_q4_k(self.raw, out)
            self._mv, self._mm = kq.matvec_q4_k8, kq.matmul_q4_k8
        return True

    def dequantize(self, out: np.ndarray) -> None:
        """out float32 (n_rows, n_cols) = the weights."""
        out = _floats("out", out, (self.n_rows, self.n_cols), True)
        self._dequantize_rows(0, self.n_rows, out)

    def _dequantize_rows(self, r0: int, r1: int, out: np.ndarray) -> None:
        if self._deq is None:
            np.copyto(out, self.raw[r0:r1].view(np.float32))
        else:
            self._deq(self.raw[r0:r1], out, _common.LANES)

    def matvec(self, x: np.ndarray, out: np.ndarray) -> None:
        """out float32 (n_rows,) = W @ x, x float32 (n_cols,)."""
        x = _floats("x", x, (self.n_cols,))
        xa = self._scratch
        if xa is None:
            xa = self._scratch = _quantize(self.act_format, x)
        else:
            _requantize_into(xa, x)
        self.matvec_act(xa, out)

    def quantize_batch(self, x: np.ndarray) -> Activation:
        """A batch x (n_tok, n_cols) in this matrix's activation format, its rows end to end (what
        matmul_act takes; shared by matrices of the same format)."""
        return _quantize(self.act_format, x.reshape(-1), batch=True)

    def matmul_act(self, xa: Activation, out: np.ndarray) -> bool:
        """out (n_tok, n_rows) = x @ W.T for x from quantize_batch; False (nothing done) for the
        types whose batches take another path (use matmul)."""
        exact = self._mm
        if exact is None or xa.format != self.act_format or xa.n != out.shape[0] * self.n_cols:
            return False
        exact(self.weights, *xa.parts, _floats("out", out, (out.shape[0], self.n_rows), True))
        return True

    def matvec_act(self, xa: Activation, out: np.ndarray) -> None:
        """out float32 (n_rows,) = W @ x for x already converted by `quantize(act_format, x)`."""
        if xa.format != self.act_format or xa.n != self.n_cols:
            raise InvalidArgumentError(
                f"{self._qtype.name} matvec needs x as {self.act_format} of {self.n_cols} values; "
                f"got {xa.format} of {xa.n}")
        out = _floats("out", out, (self.n_rows,), True)
        if self._mv is None:
            np.matmul(self.raw.view(np.float32), xa.parts[0], out=out)
        else:
            self._mv(self.weights, *xa.parts, out)

    def matvec_rows(self, xa: Activation, out: np.ndarray) -> None:
        """out (n_tok, n_rows): each token of a batch from quantize_batch through matvec_act alone
        (the one-token order for every row)."""
        n_tok = out.shape[0]
        if xa.format != self.act_format or xa.n != n_tok * self.n_cols:
            raise InvalidArgumentError(f"{self._qtype.name} rows need {n_tok} x {self.n_cols} values as "
                                       f"{self.act_format}; got {xa.format} of {xa.n}")
        one = Activation(xa.format, self.n_cols, ())
        steps = [len(p) // n_tok for p in xa.parts]
        for t in range(n_tok):
            one.parts = tuple(p[t * k:(t + 1) * k] for p, k in zip(xa.parts, steps))
            self.matvec_act(one, out[t])

    def matmul(self, x: np.ndarray, out: np.ndarray) -> None:
        """out float32 (n_tok, n_rows) = x @ W.T, x float32 (n_tok, n_cols).

        One token goes to matvec. Otherwise x is converted as for matvec and back to float32,
        W is dequantized a tile of rows at a time into a float32 scratch buffer, and BLAS
        (numpy) multiplies them: llama.cpp's numbers at BLAS speed.
        """
        n_tok = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
        x = _floats("x", x, (n_tok, self.n_cols))
        out = _floats("out", out, (n_tok, self.n_rows), True)
        if n_tok == 1:
            self.matvec(x[0], out[0])
            return
        exact = self._mm
        if exact is not None:  # the same row dot products as matvec, in llama.cpp's order
            exact(self.weights, *self.quantize_batch(x).parts, out)
            return
        xr = requantize(self.act_format, x)
        if self.ggml_type in Q8_1_WEIGHTS:
            # llama.cpp adds m_w * s_x per block with s_x = fp16(d_x * sum(q_x)); the product of
            # dequantized rows gives m_w * fp16(d_x) * sum(q_x): add the difference afterwards
            self._matmul_f32(xr, out)
            out += _q8_1_sum_error(x) @ self._block_mins().T
            return
        self._matmul_f32(xr, out)

    def _block_mins(self) -> np.ndarray:
        """float32 (n_rows, n_blocks): the f16 m of every Q4_1 / Q5_1 block (bytes 2..3)."""
        if self._mins is None:
            nb = self.n_cols // 32
            blocks = self.raw.reshape(self.n_rows, nb, -1)
            self._mins = np.ascontiguousarray(blocks[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32)
        return self._mins

    def _matmul_f32(self, xr: np.ndarray, out: np.ndarray) -> None:
        n_tok = xr.shape[0]
        if self._deq is None:
            np.matmul(xr, self.raw.view(np.float32).T, out=out)
            return
        n_rows, n_cols = self.n_rows, self.n_cols
        tile_rows = max(16, min(n_rows, _TILE_WEIGHTS // max(n_cols, 1)))
        tile = np.empty((tile_rows, n_cols), np.float32)  # dequantized rows
        if tile_rows == n_rows:
            self._dequantize_rows(0, n_rows, tile)
            np.matmul(xr, tile.T, out=out)
            return
        prod = np.empty((n_tok, tile_rows), np.float32)  # xr @ tile.T, copied into out's columns
        for r0 in range(0, n_rows, tile_rows):
            r1 = min(n_rows, r0 + tile_rows)
            self._dequantize_rows(r0, r1, tile[: r1 - r0])
            np.matmul(xr, tile[: r1 - r0].T, out=prod[:, : r1 - r0])
            out[:, r0:r1] = prod[:, : r1 - r0]


def _q8_1_sum_error(x: np.ndarray) -> np.ndarray:
    """float32 (n_tok, n/32): per Q8_1 block of each row of x, fp16(d * sum(q)) - fp16(d) * sum(q),
    with d = amax / 127 and q = round-half-even(x * 127 / amax), as ggml's x86 quantizer makes them."""
    xb = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=-1)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0))
    q_sum = np.rint(xb * inv[..., None]).sum(axis=-1, dtype=np.float32)
    s16 = (d * q_sum).astype(np.float16).astype(np.float32)
    return s16 - d.astype(np.float16).astype(np.float32) * q_sum


def bind(ggml_type, raw, n_cols: int | None = None) -> Matrix:
    """raw uint8 (n_rows, row_bytes) of `ggml_type`, checked once (n_cols from row_bytes unless
    given), with its kernels compiled or loaded: keep it per weight and call its methods."""
    return Matrix(ggml_type, raw, n_cols)


def matvec_many(mats, x: np.ndarray, outs) -> None:
    """outs[i] = mats[i] @ x for bound matrices sharing x (q/k/v, gate/up): x is converted once
    per distinct activation format."""
    converted: dict = {}
    for m, out in zip(mats, outs, strict=True):
        xa = converted.get(m.act_format)
        if xa is None:
            xa = converted[m.act_format] = quantize(m.act_format, x)
        m.matvec_act(xa, out)


# --- one-shot entry points (bind + call) ------------------------------------------------------
def _bind_for(ggml_type, raw, n_cols: int) -> Matrix:
    return Matrix(ggml_type, raw, n_cols)


def dequantize(ggml_type, raw, out: np.ndarray) -> None:
    """out float32 (n_rows, n_cols) = the weights in raw uint8 (n_rows, row_bytes)."""
    n_cols = out.shape[-1] if isinstance(out, np.ndarray) and out.ndim == 2 else -1
    _bind_for(ggml_type, raw, n_cols).dequantize(out)


def matvec(ggml_type, raw, x: np.ndarray, out: np.ndarray) -> None:
    """out float32 (n_rows,) = W @ x, x float32 (n_cols,)."""
    n_cols = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 1 else -1
    _bind_for(ggml_type, raw, n_cols).matvec(x, out)


def matmul(ggml_type, raw, x: np.ndarray, out: np.ndarray) -> None:
    """out float32 (n_tok, n_rows) = x @ W.T, x float32 (n_tok, n_cols); see Matrix.matmul."""
    n_cols = x.shape[1] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
    _bind_for(ggml_type, raw, n_cols).matmul(x, out)
