"""CUDA kernels for edgellm: CuPy RawModules built from the .cu files beside this module.

Importing this package never imports CuPy; only `require()`, `load_module()` and the backend do.
The sources are compiled by NVRTC on first use and cached by CuPy (in ~/.cupy/kernel_cache).

With EDGELLM_CUDA_EMULATE=1 (development and CI only) `require()` returns a NumPy-backed CuPy stand-in
(emulator/cupy_standin.py) whose RawModule runs these same sources on the CPU (emulator/executor.py,
built with g++), so the real backend runs without a GPU, slowly. It is never picked up otherwise.

    from edgellm.kernels import cuda
    ok, reason = cuda.available()        # never raises
    cp = cuda.require()                  # cupy, or GPUUnavailableError saying what to do
    module = cuda.load_module("quant_k") # cupy.RawModule; module.get_function("matvec_q4_k")

A module's source is its .cu file with each `#include "x.cuh"` replaced by that header's text (once),
so NVRTC needs no include path and CuPy's cache key covers every line that was compiled. The
compile-check in CI (tests/test_cuda_compile.py) feeds nvcc this same text with the same options.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent

# Options given to NVRTC through cupy.RawModule and to nvcc in CI (CuPy itself adds -ftz=true and
# the -arch of the device). No fast-math: the kernels must match their NumPy references to float32
# rounding, and expf/tanhf dominate nothing here.
COMPILE_OPTIONS: tuple[str, ...] = ("--std=c++17",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

INSTALL_HINT = (
    "install CuPy for your CUDA version: pip install 'edgellm[cuda]' (CUDA 12; for CUDA 13 use "
    "pip install cupy-cuda13x), or run with gpu_layers=0"
)


EMULATE_ENV = "EDGELLM_CUDA_EMULATE"


def emulated() -> bool:
    """True when EDGELLM_CUDA_EMULATE is set to something other than "" or "0"."""
    return os.environ.get(EMULATE_ENV, "") not in ("", "0")


def module_names() -> list[str]:
    """Names of the CUDA modules (the .cu files), sorted."""
    return sorted(p.stem for p in SOURCE_DIR.glob("*.cu"))


def module_source(module: str) -> str:
    """The self-contained source NVRTC compiles for `module` (local includes pasted in, once each)."""
    path = SOURCE_DIR / f"{module}.cu"
    if not path.is_file():
        from edgellm.errors import EdgeLLMError

        raise EdgeLLMError(f"no CUDA source {path.name} in {SOURCE_DIR}; the package install is incomplete")
    return _inline_includes(path.read_text(), seen=set())


def _inline_includes(text: str, seen: set[str]) -> str:
    def paste(match: re.Match) -> str:
        name = match.group(1)
        if name in seen:
            return f"// {name}: already included"
        seen.add(name)
        header = (SOURCE_DIR / name).read_text()
        return f"// ---- begin {name}\n{_inline_includes(header, seen)}\n// ---- end {name}"

    return _INCLUDE.sub(paste, text)


def available() -> tuple[bool, str]:
    """(True, device description) when CuPy imports and sees a CUDA device, else (False, why). Never raises."""
    if emulated():
        return _emulator_available()
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising something else
        return False, f"CuPy is not importable ({type(e).__name__}: {e}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        return False, f"no CUDA device found (CUDA runtime said: {e}); check the NVIDIA driver with nvidia-smi"
    if n < 1:
        return False, "no CUDA device found; check the NVIDIA driver with nvidia-smi"
    try:
        props = cupy.cuda.runtime.getDeviceProperties(0)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return True, f"{name}, {props['totalGlobalMem'] / 2**30:.1f} GiB, sm_{props['major']}{props['minor']}"
    except Exception as e:
        return True, f"CUDA device 0 (properties unavailable: {e})"


def _emulator_available() -> tuple[bool, str]:
    compiler = (os.environ.get("CXX") or "g++").split()[0]
    if shutil.which(compiler) is None:
        return False, f"{EMULATE_ENV}=1 runs the CUDA kernels on the CPU and needs a C++17 compiler ({compiler} not found)"
    from edgellm.kernels.cuda.emulator import cupy_standin

    return True, f"{cupy_standin.DEVICE_NAME}, {cupy_standin.emulated_vram() / 2**30:.1f} GiB ({EMULATE_ENV}=1)"


def require():
    """Return the cupy module (the CPU stand-in when EDGELLM_CUDA_EMULATE=1), or raise
    GPUUnavailableError saying what to install or check."""
    from edgellm.errors import GPUUnavailableError

    ok, reason = available()
    if not ok:
        raise GPUUnavailableError(f"GPU layers were requested but {reason}")
    if emulated():
        from edgellm.kernels.cuda.emulator import cupy_standin

        return cupy_standin
    import cupy

    return cupy


def load_module(module: str):
    """A cupy.RawModule for one .cu file (compiled by NVRTC on first use; CuPy caches the binary)."""
    cupy = require()
    return cupy.RawModule(code=module_source(module), options=COMPILE_OPTIONS)


__all__ = [
    "COMPILE_OPTIONS", "EMULATE_ENV", "INSTALL_HINT", "SOURCE_DIR", "available", "emulated", "load_module",
    "module_names", "module_source", "require",
]
