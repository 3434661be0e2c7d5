"""A NumPy-backed stand-in for the parts of CuPy that edgellm's CUDA backend uses, whose RawModule
runs the kernels on the CPU through the executor. Picked by `edgellm.kernels.cuda` only when
EDGELLM_CUDA_EMULATE=1, so the real CudaBackend (its launch code, grids, argument dtypes, uploads
and CPU<->GPU crossings) runs unchanged on a machine without a GPU.

It is as strict as CuPy where CuPy is strict, so a host/device mix-up fails here as on a GPU:
  * a device array is not a NumPy array: `np.asarray(a)` raises (use `.get()`), a NumPy array passed
    to a kernel or mixed into device arithmetic raises TypeError;
  * `empty` memory is filled with 0xff bytes (NaN / -1), as uninitialised VRAM holds garbage;
  * every allocation ends at an inaccessible page, so a kernel that reads or writes past a buffer's
    end stops with the kernel, block and thread named;
  * allocations count against the emulated VRAM ($EDGELLM_CUDA_EMULATE_VRAM, e.g. "4GiB"; default
    8 GiB) and raise cuda.memory.OutOfMemoryError past it; `memGetInfo` reports it, so the planner
    sees the emulated budget.

Like CuPy, the stand-in holds process-wide device state (the memory pool).
"""
from __future__ import annotations

import os
import time
import weakref
from types import SimpleNamespace

import numpy as np

from edgellm.kernels.cuda.emulator import executor

VRAM_ENV = "EDGELLM_CUDA_EMULATE_VRAM"
DEFAULT_VRAM = 8 << 30
DEVICE_NAME = "edgellm emulated CUDA device (CPU executor)"

float16, float32, float64 = np.float16, np.float32, np.float64
int8, int16, int32, int64 = np.int8, np.int16, np.int32, np.int64
uint8, uint16, uint32, uint64 = np.uint8, np.uint16, np.uint32, np.uint64
bool_ = np.bool_
__version__ = "emulated"


def emulated_vram() -> int:
    """Total bytes of the emulated device: $EDGELLM_CUDA_EMULATE_VRAM ("4GiB", bytes), else 8 GiB."""
    text = os.environ.get(VRAM_ENV)
    if not text:
        return DEFAULT_VRAM
    from edgellm.memory import parse_size

    return parse_size(text)


# ============================================================================ memory
class OutOfMemoryError(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError"""


class MemoryPool:
    """Counts the bytes of live device allocations (released when their last array goes)."""

    def __init__(self):
        self._used = 0
        self.peak = 0

    def allocate(self, shape, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        total = emulated_vram()
        if self._used + nbytes > total:
            raise OutOfMemoryError(f"Out of memory allocating {nbytes:,} bytes (allocated so far: "
                                   f"{self._used:,} bytes, emulated device total {total:,})")
        a = executor.guarded(shape, dtype)
        self._used += nbytes
        self.peak = max(self.peak, self._used)
        weakref.finalize(a.base if a.base is not None else a, self._release, nbytes)
        return a

    def _release(self, nbytes: int) -> None:
        self._used -= nbytes

    def used_bytes(self) -> int:
        return self._used

    def total_bytes(self) -> int:
        return self._used

    def free_all_blocks(self) -> None:
        pass


_POOL = MemoryPool()


def get_default_memory_pool() -> MemoryPool:
    return _POOL


# ============================================================================ arrays
class ndarray:  # noqa: N801 (CuPy's name)
    """A device array: a NumPy array on guarded memory that only device code and `.get()` may read."""

    __array_priority__ = 100

    def __init__(self, a: np.ndarray):
        self._a = a

    # --- what CuPy arrays expose -----------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    strides = property(lambda self: self._a.strides)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray(self._a.T))
    data = property(lambda self: SimpleNamespace(ptr=self._a.ctypes.data))

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"<emulated device array shape={self.shape} dtype={self.dtype}>"

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
                        "a NumPy array explicitly.")

    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        if out is None:
            return np.array(self._a, order=order, copy=True)
        if not isinstance(out, np.ndarray) or out.shape != self.shape or out.dtype != self.dtype:
            raise ValueError(f"get(out=...): out must be a NumPy array of shape {self.shape} and dtype {self.dtype}")
        out[...] = self._a
        return out

    def set(self, arr, stream=None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"set() takes a numpy.ndarray, not {type(arr).__name__}")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if not self.flags.c_contiguous:
            raise RuntimeError("set() needs a C-contiguous device array")
        self._a[...] = arr

    def reshape(self, *shape, order="C"):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        r = self._a.reshape(shape, order=order)
        return ndarray(r) if np.shares_memory(r, self._a) else _upload(r)

    def view(self, dtype=None):
        return ndarray(self._a.view(dtype))

    def astype(self, dtype, copy=True, order="K"):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        out = empty(self.shape, dtype)
        out._a[...] = self._a.astype(dtype)
        return out

    def copy(self, order="C"):
        return _upload(self._a)

    def fill(self, value) -> None:
        self._a.fill(value)

    def __getitem__(self, index):
        r = self._a[_index(index)]
        if np.isscalar(r) or r.ndim == 0:
            return ndarray(_device_scalar(r))
        return ndarray(r) if np.shares_memory(r, self._a) else _upload(r)

    def __setitem__(self, index, value) -> None:
        self._a[_index(index)] = _operand(value)

    def __imul__(self, other):
        self._a *= _operand(other)
        return self

    def __iadd__(self, other):
        self._a += _operand(other)
        return self

    def __mul__(self, other):
        return _upload(self._a * _operand(other))

    __rmul__ = __mul__

    def __add__(self, other):
        return _upload(self._a + _operand(other))

    __radd__ = __add__

    def __sub__(self, other):
        return _upload(self._a - _operand(other))

    def __matmul__(self, other):
        return matmul(self, other)


def _device_scalar(r) -> np.ndarray:
    a = _POOL.allocate((), np.asarray(r).dtype)
    a[...] = r
    return a


def _operand(x):
    """A device array's data, or a scalar; a NumPy array is a host/device mix-up, as in CuPy."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}: a host (NumPy) array where a device array is needed; "
                        "upload it with cupy.asarray first")
    return x


def _index(index):
    """Device arrays in an index are read as their data (CuPy takes device and host index arrays)."""
    if isinstance(index, tuple):
        return tuple(i._a if isinstance(i, ndarray) else i for i in index)
    return index._a if isinstance(index, ndarray) else index


def _upload(x: np.ndarray) -> ndarray:
    a = _POOL.allocate(x.shape, x.dtype)
    a[...] = x
    return ndarray(a)


def empty(shape, dtype=float32, order="C") -> ndarray:
    a = _POOL.allocate(shape if isinstance(shape, tuple) else (shape,) if np.isscalar(shape) else tuple(shape),
                       dtype)
    a.view(np.uint8).reshape(-1)[:] = 0xFF  # garbage, as fresh VRAM holds: NaN floats, -1 ints
    return ndarray(a)


def empty_like(a, dtype=None) -> ndarray:
    return empty(a.shape, dtype if dtype is not None else a.dtype)


def full(shape, fill_value, dtype=None) -> ndarray:
    out = empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
    out._a.fill(fill_value)
    return out


def zeros(shape, dtype=float32) -> ndarray:
    return full(shape, 0, dtype)


def asarray(a, dtype=None, order=None) -> ndarray:
    """Device array from a device array (no copy when the dtype matches) or host data (an upload)."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    return _upload(np.ascontiguousarray(np.asarray(a, dtype=dtype)))


array = asarray


def ascontiguousarray(a, dtype=None) -> ndarray:
    a = asarray(a, dtype)
    return a if a.flags.c_contiguous else _upload(np.ascontiguousarray(a._a))


def asnumpy(a, stream=None, out=None) -> np.ndarray:
    return a.get(out=out) if isinstance(a, ndarray) else np.asarray(a)


def matmul(a, b, out=None):
    """cuBLAS's product, float32 in and out. Its summation order is cuBLAS's own (and a float32 BLAS
    here would give this machine's OpenBLAS kernel's order, which changes with the CPU and the NumPy
    wheel: one such change moved a hybrid greedy check from 4 to 3 of 5 prompts), so the stand-in
    sums in float64 and rounds once: the same float32 result on every machine, within cuBLAS's own
    error of the exact product."""
    a, b = _operand(a), _operand(b)
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
    if out is None:
        return _upload(exact.astype(np.result_type(a.dtype, b.dtype)))
    o = _operand(out)
    o[...] = exact
    return out


# ============================================================================ kernels
class RawKernel:
    """A kernel of a RawModule: called as kernel(grid, block, args, shared_mem=0)."""

    def __init__(self, function: executor.EmuFunction):
        self._function = function
        self.name = function.name

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        self._function(grid, block, tuple(_kernel_arg(self.name, i, a) for i, a in enumerate(args)),
                       shared_mem=shared_mem)


def _kernel_arg(kernel: str, i: int, a):
    if isinstance(a, ndarray):
        return a._a
    if isinstance(a, np.ndarray):  # CuPy: "Unsupported type <class 'numpy.ndarray'>"
        raise TypeError(f"{kernel}: argument {i} is a NumPy (host) array; kernels take device arrays")
    return a


class RawModule:
    """cupy.RawModule(code=..., options=...): the source built for the CPU by the executor (cached)."""

    def __init__(self, code: str | None = None, path: str | None = None, options=(), backend="nvrtc",
                 name_expressions=None, **_ignored):
        import hashlib

        name = "module_" + hashlib.sha256((code or str(path)).encode()).hexdigest()[:8]
        # NVRTC options (--std=c++17, ...) do not apply to g++; the executor builds C++17 already
        self._module = executor.EmuModule(path=path, code=code, name=name,
                                          name_expressions=tuple(name_expressions or ()))

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(self._module.get_function(name))


# ============================================================================ cuda namespace
class _Device:
    def __init__(self, device_id: int = 0):
        if int(device_id) != 0:
            raise RuntimeError(f"cudaErrorInvalidDevice: the emulated machine has one device (0), not {device_id}")
        self.id = 0

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Stream:
    def synchronize(self) -> None:
        pass  # kernels run to completion when launched


class _Event:
    def __init__(self, *args, **kwargs):
        self.t = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass


def _get_elapsed_time(start: _Event, end: _Event) -> float:
    return (end.t - start.t) * 1000.0


def _mem_get_info() -> tuple[int, int]:
    total = emulated_vram()
    return max(0, total - _POOL.used_bytes()), total


def _device_properties(device_id: int = 0) -> dict:
    _Device(device_id)
    return {"name": DEVICE_NAME.encode(), "totalGlobalMem": emulated_vram(), "major": 9, "minor": 0,
            "multiProcessorCount": 1, "warpSize": 32, "maxThreadsPerBlock": 1024, "sharedMemPerBlock": 48 * 1024}


_runtime = SimpleNamespace(
    getDeviceCount=lambda: 1,
    getDeviceProperties=_device_properties,
    memGetInfo=_mem_get_info,
    runtimeGetVersion=lambda: 12000,
    driverGetVersion=lambda: 12000,
)

cuda = SimpleNamespace(
    Device=_Device,
    Event=_Event,
    Stream=_Stream,
    get_current_stream=lambda: _Stream(),
    get_elapsed_time=_get_elapsed_time,
    alloc_pinned_memory=lambda nbytes: bytearray(int(nbytes)),
    memory=SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    runtime=_runtime,
)

__all__ = [
    "RawKernel", "RawModule", "asarray", "ascontiguousarray", "asnumpy", "cuda", "empty", "empty_like", "emulated_vram", "full",
    "get_default_memory_pool", "matmul", "ndarray", "zeros",
]
