"""Memory sizes and budgets: parse "4GiB", print MiB/GiB, and ask the machine how much is free.

Free RAM comes from psutil; free VRAM from NVML (the driver's management library, loaded with ctypes:
no context is created and nothing is allocated on the GPU), else from CuPy. edgellm's GPU path needs
CuPy, so without it the GPU budget is 0 even when a GPU is present. CuPy is imported only when it is
installed and NVML could not answer.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import re
from dataclasses import dataclass

from edgellm.errors import InvalidArgumentError

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gib": GiB, "gb": 1000**3,
    "t": TiB, "tib": TiB, "tb": 1000**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """"4GiB" -> 4294967296. KiB/MiB/GiB/TiB and bare K/M/G/T are powers of 1024; KB/MB/GB/TB are
    powers of 1000; no unit means bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise InvalidArgumentError(f"cannot read size {text!r}: write a number and a unit, e.g. 4GiB, 512MiB, 8GB")
    return int(float(m.group(1)) * unit)


def format_size(n: int) -> str:
    """Bytes -> "512.0 MiB" / "12.55 GiB" (binary units, like nvidia-smi's MiB)."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    if abs(n) >= KiB:
        return f"{n / KiB:.1f} KiB"
    return f"{n} B"


@dataclass(frozen=True)
class Budgets:
    """Bytes the planner may use per device, and where each number came from."""

    cpu: int
    gpu: int
    cpu_source: str = "given"
    gpu_source: str = "given"


def free_ram() -> int:
    """Bytes of RAM available to a new allocation without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def _visible_gpu_index() -> int | None:
    """The NVML index of the device CUDA calls 0, None when CUDA_VISIBLE_DEVICES hides them all."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 0
    first = visible.split(",")[0].strip()
    if not first or first.startswith("-"):
        return None
    return int(first) if first.isdigit() else 0  # a UUID / MIG name: NVML index 0 is the best guess


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _free_vram_nvml(index: int) -> int | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle, mem = ctypes.c_void_p(), _NvmlMemory()
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
            return None
        return int(mem.free)
    finally:
        nvml.nvmlShutdown()


def _free_vram_cupy() -> int | None:
    try:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
        return int(free)
    except Exception:  # no device, no driver, broken install: all mean "no GPU budget"
        return None


def free_vram() -> tuple[int, str]:
    """(free bytes on the first visible GPU, where the number came from); (0, why) without one."""
    from edgellm.kernels.cuda import emulated

    if emulated():  # EDGELLM_CUDA_EMULATE=1: the CPU stand-in's device (development and CI)
        from edgellm.kernels.cuda.emulator import cupy_standin

        return cupy_standin.cuda.runtime.memGetInfo()[0], "free on the emulated GPU (EDGELLM_CUDA_EMULATE=1)"
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed (pip install 'edgellm[cuda]')"
    index = _visible_gpu_index()
    if index is None:
        return 0, "CUDA_VISIBLE_DEVICES hides every GPU"
    free = _free_vram_nvml(index)
    if free is not None:
        return free, f"free on GPU {index} (NVML)"
    free = _free_vram_cupy()
    if free is not None:
        return free, "free on GPU 0 (CuPy)"
    return 0, "no CUDA device found"


def detect_budgets(vram: str | int | None = None, ram: str | int | None = None) -> Budgets:
    """Budgets from the machine, each replaced by `vram` / `ram` when given ("4GiB", bytes)."""
    if ram is not None:
        cpu, cpu_source = parse_size(ram), "--ram"
    else:
        cpu, cpu_source = free_ram(), "available RAM (psutil)"
    if vram is not None:
        gpu, gpu_source = parse_size(vram), "--vram"
    else:
        gpu, gpu_source = free_vram()
    return Budgets(cpu=cpu, gpu=gpu, cpu_source=cpu_source, gpu_source=gpu_source)
