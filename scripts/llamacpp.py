"""Where llama.cpp's tools and library are, for the scripts that run them (dev only: llama.cpp is a
reference, never an edgellm dependency).

A program (llama-bench, llama-quantize, llama-perplexity, llama-server, llama-batched-bench) or the
library (libllama.so) is looked up, first to last, in the folder given by `--llama-bin DIR`, in the
folder named by the LLAMA_BIN environment variable, then on PATH (the library last in
llama-cpp-python's own build). A cmake build of llama.cpp puts both its programs and its shared
libraries in build/bin, so one folder answers for both.

A script in a folder under scripts/ imports this module with
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
from pathlib import Path

ENV = "LLAMA_BIN"


def add_argument(ap: argparse.ArgumentParser) -> None:
    """The shared `--llama-bin DIR` flag."""
    ap.add_argument("--llama-bin", type=Path, default=None, metavar="DIR",
                    help=f"folder with llama.cpp's programs and libllama.so (default: ${ENV}, then PATH)")


def _folders(llama_bin: Path | str | None) -> list[Path]:
    given = [llama_bin, os.environ.get(ENV)]
    return [Path(d).expanduser() for d in given if d]


def tool(name: str, llama_bin: Path | str | None = None) -> Path:
    """The path of llama.cpp's program `name`; SystemExit with what to do when it is nowhere."""
    for folder in _folders(llama_bin):
        path = folder / name
        if path.is_file() and os.access(path, os.X_OK):
            return path.resolve()
    found = shutil.which(name)
    if found:
        return Path(found).resolve()
    raise SystemExit(f"{name} not found: pass --llama-bin DIR (a llama.cpp build's bin folder), "
                     f"set {ENV}=DIR, or put it on PATH")


def library_dir(llama_bin: Path | str | None = None) -> Path:
    """The folder holding libllama.so (and the libggml libraries beside it): --llama-bin, $LLAMA_BIN,
    PATH's folders (and their ../lib), then llama-cpp-python's own build when it is installed."""
    candidates = _folders(llama_bin)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if entry:
            candidates += [Path(entry), Path(entry).parent / "lib"]
    try:
        import llama_cpp
        candidates.append(Path(llama_cpp.__file__).parent / "lib")
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "libllama.so").is_file():
            return folder.resolve()
    raise SystemExit(f"libllama.so not found: pass --llama-bin DIR (a llama.cpp build's bin folder), "
                     f"set {ENV}=DIR, or put that folder on PATH")


def env_for(program: Path) -> dict[str, str]:
    """The environment to run `program` in: its own folder first on LD_LIBRARY_PATH (a build's
    programs load their shared libraries from beside them)."""
    old = os.environ.get("LD_LIBRARY_PATH")
    return dict(os.environ, LD_LIBRARY_PATH=str(program.parent) + (os.pathsep + old if old else ""))


class QuantizeParams(ctypes.Structure):  # llama.h: llama_model_quantize_params (0.3.36's vendor tree)
    _fields_ = [
        ("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
        ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
        ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
        ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
        ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
        ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t),
    ]


def load_libllama(llama_bin: Path | str | None = None) -> ctypes.CDLL:
    """libllama.so, its ggml libraries loaded first, with llama_model_quantize's signature set."""
    lib_dir = library_dir(llama_bin)
    for dep in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        if (lib_dir / dep).exists():
            ctypes.CDLL(str(lib_dir / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    lib.llama_backend_init()
    return lib


def llama_quantize(lib: ctypes.CDLL, src: Path, dst: Path, ftype: str, threads: int,
                   allow_requantize: bool) -> float:
    """llama_model_quantize(src -> dst, ftype such as "Q4_K_M"; no importance matrix): seconds taken."""
    import time

    from gguf import LlamaFileType

    p = lib.llama_model_quantize_default_params()
    p.ftype = int(getattr(LlamaFileType, "ALL_F32" if ftype == "F32" else f"MOSTLY_{ftype}"))
    p.nthread = threads
    p.allow_requantize = allow_requantize
    t0 = time.perf_counter()
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src} -> {ftype}")
    return time.perf_counter() - t0
