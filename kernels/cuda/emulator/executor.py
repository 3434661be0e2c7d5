"""The CUDA-on-CPU executor: runs the CUDA C kernels (.cu sources) on the CPU, with a
cupy.RawModule-like interface. Used by the CuPy stand-in (`cupy_standin`, EDGELLM_CUDA_EMULATE=1)
and by the tests; never by the CPU path.

    from edgellm.kernels.cuda.emulator.executor import EmuModule, guarded
    mod = EmuModule(path="kernels/cuda/norm_rope.cu")     # or EmuModule(code=source_text, name="norm_rope")
    fn = mod.get_function("rms_norm_f32")
    fn((n_rows,), (256,), (x, w, np.int32(1), out, np.int32(n), np.float32(eps), np.int64(n), np.int64(n)))

Arguments follow CuPy's RawKernel rules: NumPy arrays are passed as pointers (their data address),
NumPy scalars by value with their own type (np.int32 -> int, np.int64 -> long long, np.float32 ->
float, ...), Python int -> long long, float -> double, bool -> bool. Unlike a GPU, the executor checks
each argument's type against the kernel's parameter (pointer / integer / float and size) and fails
with a message when they differ.

How a source becomes a shared library (built once with g++, cached by content hash in cache_dir()):
  1. local `#include "x.cuh"` are pasted in (once each) with #line markers, so __LINE__ and compiler
     messages name the original files;
  2. inline PTX `asm("op ..." : "=c"(out) : "c"(in));` becomes EMU_PTX("op ...", out, in) (only the
     instructions cudaemu.h emulates are accepted); `extern __shared__ T name[];` becomes a pointer to
     the emulator's dynamic shared memory;
  3. a preprocessor pass finds the extern "C" __global__ kernels and their __launch_bounds__, and a
     launcher `emu_launch_<i>` is generated for each;
  4. g++ -x c++ -include cudaemu.h builds it.

Environment: CXX (default g++), EDGELLM_CUDAEMU_CACHE (default <edgellm cache dir>/cudaemu),
CUDAEMU_CXXFLAGS (extra flags), CUDAEMU_ORDER (forward|reverse|random), CUDAEMU_SEED.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import mmap
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHIM = Path(os.environ.get("CUDAEMU_SHIM", HERE / "cudaemu.h"))
CXXFLAGS = ["-std=c++17", "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-strict-aliasing", "-ffp-contract=off",
            "-Wno-unknown-pragmas", "-Wno-attributes"]
ORDERS = {"forward": 0, "reverse": 1, "random": 2}
PTX_SUPPORTED = ("cvt.f32.f16", "cvt.rn.f16.f32", "mov.b32", "mov.u32", "mov.s32", "mov.b64", "mov.u64", "mov.s64")
STUB_HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_fp16.h", "cuda_bf16.h", "device_launch_parameters.h",
                "cooperative_groups.h")


def cache_dir() -> Path:
    """Where built libraries are kept: $EDGELLM_CUDAEMU_CACHE, else <edgellm cache dir>/cudaemu, else a
    folder in the temp dir when the user cache cannot be written."""
    if os.environ.get("EDGELLM_CUDAEMU_CACHE"):
        return Path(os.environ["EDGELLM_CUDAEMU_CACHE"])
    try:
        from edgellm.fetch import cache_dir as edgellm_cache

        d = edgellm_cache() / "cudaemu"
        d.mkdir(parents=True, exist_ok=True)
        if os.access(d, os.W_OK):
            return d
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "edgellm-cudaemu"


class EmuError(RuntimeError):
    """A kernel failed under emulation (bad launch, argument mismatch, divergent barrier, deadlock...)."""


class EmuBuildError(RuntimeError):
    """The source could not be prepared or compiled for the CPU."""


# ---------------------------------------------------------------------------------------------- source
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)
_ASM = re.compile(
    r'\basm\s*(?:volatile\s*|__volatile__\s*)?\(\s*"((?:[^"\\]|\\.)*)"\s*'
    r':\s*"=[a-z]+"\s*\(([^()]*)\)\s*:\s*"[a-z]+"\s*\(([^()]*)\)\s*\)\s*;')
_ALIGN = r'(?:__align__\s*\((?:[^()]|\([^()]*\))*\)\s*)?'
_EXTERN_SHARED = re.compile(
    r'\bextern\s+' + _ALIGN + r'__shared__\s+' + _ALIGN + r'([A-Za-z_][\w:<>, ]*?[\s*]*?)\s*' + _ALIGN +
    r'\b(\w+)\s*\[\s*\]\s*;')


def inline_includes(text: str, base_dir: Path, include_dirs=(), seen=None, file_label="source.cu") -> str:
    """Paste each local `#include "x"` (searched in the including file's folder, then include_dirs)
    once, with #line markers."""
    seen = set() if seen is None else seen
    out, last = [], 0
    for m in _INCLUDE.finditer(text):
        name = m.group(1)
        for d in (base_dir, *map(Path, include_dirs)):
            path = (d / name).resolve()
            if path.is_file():
                break
        else:
            raise EmuBuildError(f"{file_label}: cannot find included file {name!r}")
        line_after = text.count("\n", 0, m.end()) + 2
        out.append(text[last:m.start()])
        if str(path) in seen:
            out.append(f"// {name}: already included\n")
        else:
            seen.add(str(path))
            body = inline_includes(path.read_text(), path.parent, include_dirs, seen, name)
            out.append(f'#line 1 "{name}"\n{body}\n')
        out.append(f'#line {line_after} "{file_label}"\n')
        last = m.end() + 1 if text[m.end():m.end() + 1] == "\n" else m.end()
    out.append(text[last:])
    return "".join(out)


def rewrite(text: str) -> str:
    """Inline PTX -> EMU_PTX(...); extern __shared__ arrays -> the dynamic shared memory buffer."""
    def asm(m):
        op = m.group(1).split()[0].rstrip(";") if m.group(1).split() else ""
        if op not in PTX_SUPPORTED:
            line = text.count("\n", 0, m.start()) + 1
            raise EmuBuildError(f"inline PTX {m.group(1)!r} (prepared line {line}) is not emulated; "
                                f"supported: {', '.join(PTX_SUPPORTED)} (extend emu::ptx in cudaemu.h)")
        return f'EMU_PTX("{m.group(1)}", {m.group(2).strip()}, {m.group(3).strip()});'

    text = _ASM.sub(asm, text)
    text = re.sub(r'\bstatic\s+__shared__\b', "__shared__", text)
    text = _EXTERN_SHARED.sub(
        lambda m: f"{m.group(1).strip()}* const {m.group(2)} = "
                  f"reinterpret_cast<{m.group(1).strip()}*>(::emu::dynamic_shared());", text)
    text = _SHARED.sub(lambda m: f"{m.group(0)} EMU_SHARED_REG({m.group(2)});", text)
    return text


_SHARED = re.compile(
    r'(?<![\w])__shared__\s+(' + _ALIGN + r'[A-Za-z_][\w:<>, *]*?)\s*\b(\w+)\s*((?:\[[^\]]*\]\s*)*);')

_KERNEL = re.compile(
    r'extern\s+"C"\s+(?:__emu_global__\s+void|void\s+__emu_global__)\s+'
    r'(?:__emu_launch_bounds__\s*\((?P<lb>(?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)\s*)?(?P<name>\w+)\s*\(')


def _split_top(s: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    return parts + [cur]


@functools.lru_cache(maxsize=None)
def _compiler_id_of(cxx: tuple[str, ...]) -> tuple[str, ...]:
    r = subprocess.run([*cxx, "--version"], capture_output=True, text=True)
    return tuple(r.stdout.splitlines()[:1])


def _compiler_id() -> tuple[str, ...]:
    """The compiler's first --version line (part of the cache key)."""
    return _compiler_id_of(tuple(_cxx()))


def _cxx() -> list[str]:
    return (os.environ.get("CXX") or "g++").split()


def _stub_dir() -> Path:
    d = cache_dir() / "stub_include"
    d.mkdir(parents=True, exist_ok=True)
    for name in STUB_HEADERS:
        p = d / name
        if not p.exists():
            p.write_text("#pragma once\n// cudaemu: everything is in cudaemu.h\n")
    return d


def find_kernels(prepared: str, flags: list[str]) -> list[tuple[str, str]]:
    """(name, launch bound expression or '0') of each extern "C" __global__ kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "scan.cu"
        src.write_text(prepared)
        cmd = [*_cxx(), "-E", "-P", "-x", "c++", "-std=c++17", "-DEMU_SCAN", "-include", str(SHIM),
               f"-I{_stub_dir()}", *flags, str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise EmuBuildError(f"preprocessing failed:\n{r.stderr}")
    found = []
    for m in _KERNEL.finditer(r.stdout):
        lb = m.group("lb")
        found.append((m.group("name"), _split_top(lb)[0].strip() if lb else "0"))
    return found


def build(code: str, name: str = "module", base_dir: Path | None = None, include_dirs=(), options=(),
          name_expressions=()) -> tuple[Path, dict[str, str]]:
    """Build (or find in the cache) the shared library of one CUDA source. Returns (path, kernel name ->
    launcher symbol)."""
    base_dir = Path(base_dir or ".")
    extra = [*os.environ.get("CUDAEMU_CXXFLAGS", "").split(), *options,
             *[f"-I{d}" for d in include_dirs], f"-I{base_dir}"]
    prepared = rewrite(inline_includes(code, base_dir, include_dirs, file_label=f"{name}.cu"))
    key = hashlib.sha256("\0".join([SHIM.read_text(), prepared, *name_expressions, *CXXFLAGS, *extra,
                                     *_compiler_id()]).encode()).hexdigest()[:20]
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    so = cache / f"{name}-{key}.so"
    listing = cache / f"{name}-{key}.kernels.json"  # the scan's result, so a cached build needs no g++ run
    if so.exists() and listing.exists():
        kernels = [tuple(k) for k in json.loads(listing.read_text())]
        return so, {kname: f"emu_launch_{i}" for i, (kname, _lb) in enumerate(kernels)}
    kernels = find_kernels(prepared, extra)
    for expr in name_expressions:
        kernels.append((expr, "0"))
    if not kernels:
        raise EmuBuildError(f"{name}: no extern \"C\" __global__ kernel found")
    symbols, wrappers = {}, []
    for i, (kname, lb) in enumerate(kernels):
        sym = f"emu_launch_{i}"
        symbols[kname] = sym
        wrappers.append(
            f'extern "C" __attribute__((visibility("default"), used)) int {sym}(const unsigned* g, const unsigned* b, '
            f'unsigned long long shmem, void** args, const char* codes, int n) {{\n'
            f'    return ::emu::launch_packed("{kname}", &{kname}, g, b, (size_t)shmem, args, codes, n, (int)({lb}));\n}}\n')
    full = prepared + "\n\n// ---- cudaemu launchers\n" + "".join(wrappers)
    src = cache / f"{name}-{key}.{os.getpid()}.cu"
    src.write_text(full)
    tmp = so.with_suffix(f".{os.getpid()}.tmp")
    cmd = [*_cxx(), "-x", "c++", *CXXFLAGS, "-include", str(SHIM), f"-I{_stub_dir()}", *extra, str(src),
           "-o", str(tmp)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise EmuBuildError(f"compiling {name} for the CPU failed ({' '.join(cmd)}):\n{r.stderr[-6000:]}")
    src.unlink()
    os.replace(tmp, so)
    listing_tmp = listing.with_suffix(f".{os.getpid()}.tmp")
    listing_tmp.write_text(json.dumps(kernels))
    os.replace(listing_tmp, listing)
    return so, symbols


# ---------------------------------------------------------------------------------------------- running
def _dims(d) -> tuple[int, int, int]:
    if isinstance(d, (int, np.integer)):
        d = (int(d),)
    d = tuple(int(v) for v in d) + (1,) * (3 - len(d))
    if len(d) != 3:
        raise ValueError(f"grid/block must have 1 to 3 dimensions, got {d}")
    return d


def _pack(arg):
    """(object that owns the bytes, address, type code)"""
    if isinstance(arg, np.ndarray):
        holder = np.array([arg.ctypes.data], dtype=np.uint64)
        return holder, holder.ctypes.data, "p"
    if isinstance(arg, (bool, np.bool_)):
        holder = np.array([bool(arg)], dtype=np.bool_)
        return holder, holder.ctypes.data, "b1"
    if isinstance(arg, np.generic):
        holder = np.array([arg], dtype=arg.dtype)
        kind = {"i": "i", "u": "u", "f": "f"}.get(arg.dtype.kind)
        if kind is None:
            raise TypeError(f"unsupported kernel argument type {arg.dtype}")
        return holder, holder.ctypes.data, f"{kind}{arg.dtype.itemsize}"
    if isinstance(arg, int):
        holder = np.array([arg], dtype=np.int64)
        return holder, holder.ctypes.data, "i8"
    if isinstance(arg, float):
        holder = np.array([arg], dtype=np.float64)
        return holder, holder.ctypes.data, "f8"
    if isinstance(arg, DevicePointer):
        holder = np.array([arg.address], dtype=np.uint64)
        return holder, holder.ctypes.data, "p"
    raise TypeError(f"unsupported kernel argument {type(arg).__name__}")


class DevicePointer:
    """A raw address passed as a pointer argument (e.g. into the middle of a buffer)."""

    def __init__(self, address: int):
        self.address = int(address)


class EmuFunction:
    def __init__(self, module: "EmuModule", name: str, symbol: str):
        self.module, self.name = module, name
        self._fn = getattr(module.lib, symbol)
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_char_p,
                             ctypes.c_int]

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        g = np.array(_dims(grid), dtype=np.uint32)
        b = np.array(_dims(block), dtype=np.uint32)
        packed = [_pack(a) for a in args]
        ptrs = (ctypes.c_void_p * max(1, len(packed)))(*[p[1] for p in packed])
        codes = " ".join(p[2] for p in packed).encode()
        rc = self._fn(g.ctypes.data, b.ctypes.data, int(shared_mem), ptrs, codes, len(packed))
        if rc:
            raise EmuError(self.module.lib.emu_last_error().decode())


class EmuModule:
    """The CPU twin of cupy.RawModule(code=...) / RawModule(path=...)."""

    def __init__(self, path=None, code: str | None = None, name: str | None = None, include_dirs=(), options=(),
                 name_expressions=(), order: str | None = None, seed: int | None = None, shared_fill: int = 0xFF,
                 stack_bytes: int = 64 * 1024, strict_exit: bool = False):
        if (path is None) == (code is None):
            raise ValueError("give path or code")
        if path is not None:
            path = Path(path)
            code = path.read_text()
            base_dir, name = path.parent, name or path.stem
        else:
            base_dir, name = Path(include_dirs[0]) if include_dirs else Path("."), name or "module"
        self.name = name
        self.path, self.symbols = build(code, name, base_dir, include_dirs, options, name_expressions)
        self.lib = ctypes.CDLL(str(self.path), mode=os.RTLD_LOCAL)
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_set_options.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong,
                                             ctypes.c_int]
        self.lib.emu_static_shared_bytes.restype = ctypes.c_ulonglong
        order = order or os.environ.get("CUDAEMU_ORDER", "forward")
        seed = int(os.environ.get("CUDAEMU_SEED", "1")) if seed is None else seed
        self.set_options(order, seed, shared_fill, stack_bytes, strict_exit)
        self._functions: dict[str, EmuFunction] = {}

    def set_options(self, order="forward", seed=1, shared_fill=0xFF, stack_bytes=64 * 1024, strict_exit=False):
        """order: the order runnable threads are resumed in (forward, reverse, random); shared_fill: the byte
        written over shared memory before each block (-1: none)."""
        self.lib.emu_set_options(ORDERS[order], seed, shared_fill, stack_bytes, int(strict_exit))

    def get_function(self, name: str) -> EmuFunction:
        if name not in self._functions:
            if name not in self.symbols:
                raise EmuError(f"{self.name}: no kernel {name!r}; found {sorted(self.symbols)}")
            self._functions[name] = EmuFunction(self, name, self.symbols[name])
        return self._functions[name]

    def stats(self) -> dict[str, int]:
        v = (ctypes.c_ulonglong * 7)()
        self.lib.emu_get_stats(v)
        keys = ("launches", "blocks", "threads", "context_switches", "block_barriers", "warp_collectives",
                "exits_while_others_at_barrier")
        return dict(zip(keys, map(int, v)))

    @property
    def static_shared_bytes(self) -> int:
        """Bytes of __shared__ variables of all kernels of the module together."""
        return int(self.lib.emu_static_shared_bytes())


# ---------------------------------------------------------------------------------------------- buffers
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
PAGE = mmap.PAGESIZE


def guarded(shape, dtype, fill=None) -> np.ndarray:
    """A C-contiguous array whose last byte sits just before an inaccessible page, so a kernel that reads
    or writes past its end faults (and cudaemu names the kernel, block and thread). Its start is
    aligned as far as its size allows (a size that is a multiple of 16 gives a 16-byte aligned start)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    n = count * dtype.itemsize
    data_pages = max(1, -(-n // PAGE))
    mm = mmap.mmap(-1, (data_pages + 1) * PAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    if _libc.mprotect(ctypes.c_void_p(base + data_pages * PAGE), PAGE, 0) != 0:
        raise OSError(ctypes.get_errno(), "mprotect failed")
    a = np.frombuffer(mm, dtype=dtype, count=count, offset=data_pages * PAGE - n).reshape(shape)
    if fill is not None:
        a[...] = fill
    return a


def guarded_copy(x: np.ndarray) -> np.ndarray:
    a = guarded(x.shape, x.dtype)
    a[...] = x
    return a


__all__ = ["EmuModule", "EmuFunction", "EmuError", "EmuBuildError", "DevicePointer", "guarded", "guarded_copy",
           "build", "inline_includes", "rewrite"]


def _main(argv=None) -> int:
    """python -m edgellm.kernels.cuda.emulator.executor FILE.cu [-I DIR]...: build FILE.cu for the CPU, print the library and its kernels."""
    import argparse

    ap = argparse.ArgumentParser(description="build a .cu file for the CPU (cached) and list its kernels")
    ap.add_argument("source")
    ap.add_argument("-I", dest="include_dirs", action="append", default=[])
    a = ap.parse_args(argv)
    m = EmuModule(path=a.source, include_dirs=a.include_dirs)
    print(m.path)
    for name in sorted(m.symbols):
        print(f"  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
