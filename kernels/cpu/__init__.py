"""Numba CPU kernels for the GGML tensor types: dequantize, matvec (decode), matmul (prompt batches).

```python
from edgellm.kernels import cpu
cpu.dequantize(ggml_type, raw, out)   # raw uint8 (n_rows, row_bytes), out float32 (n_rows, n_cols)
cpu.matvec(ggml_type, raw, x, out)    # x float32 (n_cols,), out float32 (n_rows,): out = W @ x
cpu.matmul(ggml_type, raw, x, out)    # x float32 (n_tok, n_cols), out (n_tok, n_rows): x @ W.T
cpu.supported_types() -> list[GGMLType]
cpu.set_threads(n)                    # Numba worker threads for the kernels
```
`raw` may be a read-only memmap view of a GGUF file; it is never copied. The kernels of a type
family (dense, legacy, kquants) are imported, and compiled, on the first call that needs them, so
importing this package does not import Numba. Compiled code is cached on disk under the user
cache dir (NUMBA_CACHE_DIR, unless the user set it).
"""
from __future__ import annotations

import os
from importlib import import_module
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.errors import InvalidArgumentError
from edgellm.quants import quant_type

# GGMLType -> module (in this package) holding its kernels, as `OPS`.
_FAMILY = {
    GGMLType.F32: "dense",
    GGMLType.F16: "dense",
    GGMLType.BF16: "dense",
    GGMLType.Q4_0: "legacy",
    GGMLType.Q4_1: "legacy",
    GGMLType.Q5_0: "legacy",
    GGMLType.Q5_1: "legacy",
    GGMLType.Q8_0: "legacy",
    GGMLType.Q2_K: "kquants",
    GGMLType.Q3_K: "kquants",
    GGMLType.Q4_K: "kquants",
    GGMLType.Q5_K: "kquants",
    GGMLType.Q6_K: "kquants",
}

# matmul dequantizes this many weights per tile (2 MiB of float32) before handing it to BLAS.
_TILE_WEIGHTS = 1 << 19


def supported_types() -> list[GGMLType]:
    return list(_FAMILY)


def numba_cache_dir() -> Path:
    """Where compiled kernels are cached: edgellm's user cache dir (see edgellm.fetch) / numba."""
    from edgellm.fetch import cache_dir

    return cache_dir() / "numba"


def _ops(ggml_type):
    """The kernel family for a type, imported (and its numba cache dir set) on first use."""
    qtype = quant_type(ggml_type)  # raises UnsupportedTensorTypeError for unknown ids
    if "NUMBA_CACHE_DIR" not in os.environ:
        os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
        import numba  # already imported by someone else: its config read the env too early

        numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    return qtype, import_module(f"{__name__}.{_FAMILY[qtype.ggml_type]}").OPS


def set_threads(n: int) -> None:
    """Number of threads the kernels use (at most the number of CPU cores Numba sees)."""
    import numba

    if not 1 <= int(n) <= numba.config.NUMBA_NUM_THREADS:
        raise InvalidArgumentError(
            f"threads={n} is out of range; use 1 .. {numba.config.NUMBA_NUM_THREADS}")
    numba.set_num_threads(int(n))


# --- argument checks ------------------------------------------------------------------------
def _weights(qtype, raw, n_cols: int) -> np.ndarray:
    """raw as a read-only C-contiguous uint8 (n_rows, row_bytes) view (never a copy)."""
    raw = np.asarray(raw)
    if raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{qtype.name} weights must be a C-contiguous uint8 array (n_rows, row_bytes); got "
            f"{raw.dtype} {raw.shape}, contiguous={raw.flags.c_contiguous}")
    if n_cols % qtype.block_size or raw.shape[1] != qtype.row_bytes(n_cols):
        raise InvalidArgumentError(
            f"{qtype.name} rows of {n_cols} weights take {qtype.row_bytes(n_cols)} bytes "
            f"(n_cols a multiple of {qtype.block_size}); the weights have {raw.shape[1]} per row")
    view = raw.view()
    view.flags.writeable = False  # one compiled variant for memmaps and in-memory arrays
    return view


def _floats(name: str, a, shape: tuple, writable: bool = False) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape \
            or not a.flags.c_contiguous or (writable and not a.flags.writeable):
        what = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
        raise InvalidArgumentError(
            f"{name} must be a {'writable ' if writable else ''}C-contiguous float32 array of "
            f"shape {shape}; got {what}")
    return a


# --- entry points ---------------------------------------------------------------------------
def dequantize(ggml_type, raw, out: np.ndarray) -> None:
    """out float32 (n_rows, n_cols) = the weights in raw uint8 (n_rows, row_bytes)."""
    qtype, ops = _ops(ggml_type)
    n_cols = out.shape[-1] if isinstance(out, np.ndarray) and out.ndim == 2 else -1
    raw = _weights(qtype, raw, n_cols)
    ops.dequantize(qtype.ggml_type, raw, _floats("out", out, (raw.shape[0], n_cols), True))


def matvec(ggml_type, raw, x: np.ndarray, out: np.ndarray) -> None:
    """out float32 (n_rows,) = W @ x, x float32 (n_cols,)."""
    qtype, ops = _ops(ggml_type)
    n_cols = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 1 else -1
    raw = _weights(qtype, raw, n_cols)
    x = _floats("x", x, (n_cols,))
    ops.matvec(qtype.ggml_type, raw, x, _floats("out", out, (raw.shape[0],), True))


def matmul(ggml_type, raw, x: np.ndarray, out: np.ndarray) -> None:
    """out float32 (n_tok, n_rows) = x @ W.T, x float32 (n_tok, n_cols).

    One token goes to matvec. Otherwise W is dequantized a tile of rows at a time into a float32
    scratch buffer and multiplied by BLAS (numpy), which is compute-bound and exact to float32.
    """
    qtype, ops = _ops(ggml_type)
    n_tok, n_cols = x.shape if isinstance(x, np.ndarray) and x.ndim == 2 else (-1, -1)
    raw = _weights(qtype, raw, n_cols)
    x = _floats("x", x, (n_tok, n_cols))
    out = _floats("out", out, (n_tok, raw.shape[0]), True)
    if n_tok == 1:
        ops.matvec(qtype.ggml_type, raw, x[0], out[0])
        return
    if hasattr(ops, "matmul"):
        ops.matmul(qtype.ggml_type, raw, x, out)
        return
    n_rows = raw.shape[0]
    tile_rows = max(16, min(n_rows, _TILE_WEIGHTS // max(n_cols, 1)))
    tile = np.empty((tile_rows, n_cols), np.float32)  # dequantized rows
    prod = np.empty((n_tok, tile_rows), np.float32)  # x @ tile.T, copied into out's columns
    for r0 in range(0, n_rows, tile_rows):
        r1 = min(n_rows, r0 + tile_rows)
        ops.dequantize(qtype.ggml_type, raw[r0:r1], tile[: r1 - r0])
        np.matmul(x, tile[: r1 - r0].T, out=prod[:, : r1 - r0])
        out[:, r0:r1] = prod[:, : r1 - r0]
