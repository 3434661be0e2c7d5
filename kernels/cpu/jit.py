"""The JIT's life cycle in one place: where compiled kernels are cached, how many threads they run
on and from which thread (`KERNEL_THREAD`), who hears of a kernel compiling, when the compiler's
memory is handed back, and what is ready (`STATE`: the fused decode kernel may still be compiling
in precompile's workers).

None of this imports Numba until a function here needs it.
"""
from __future__ import annotations

import os
import queue
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from edgellm.errors import InvalidArgumentError

_PACKAGE = __name__.rsplit(".", 1)[0]  # edgellm.kernels.cpu


class KernelState:
    """What this process's kernels have ready. While precompile's worker still compiles the fused
    decode kernel, decode steps run the unfused kernels (the same bits), so a first run answers
    before the largest kernel is compiled; once it is in the disk cache the next step loads it."""

    def __init__(self):
        self._fused = threading.Event()
        self._fused.set()

    @property
    def fused_ready(self) -> bool:
        return self._fused.is_set()

    def fused_compiling(self) -> None:
        """The fused decode kernel is being compiled elsewhere: run the unfused kernels meanwhile."""
        self._fused.clear()

    def fused_compiled(self) -> None:
        self._fused.set()


STATE = KernelState()


class KernelThread:
    """The one thread that runs a process's model steps. OpenMP (libgomp) gives every thread that
    starts a parallel region a team of its own, and once the teams' threads outnumber the cores it
    stops spin-waiting in all of them, so kernels started from a second thread slow every step
    (docs/performance.md). call() runs fn here and returns its result or raises its exception."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def call(self, fn, *args):
        thread = self._thread
        if thread is threading.current_thread():
            return fn(*args)
        if thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._serve, name="edgellm-kernels", daemon=True)
                    self._thread.start()
        done = threading.Lock()
        done.acquire()
        box = [None, None]
        self._jobs.put((fn, args, box, done))
        interrupted = None
        while True:  # a Ctrl-C waits for the step to end: its buffers and cache are in use until then
            try:
                done.acquire()
                break
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                interrupted = interrupted or e
        if interrupted is not None:
            raise interrupted
        if box[1] is not None:
            raise box[1]
        return box[0]

    def _serve(self) -> None:
        while True:
            fn, args, box, done = self._jobs.get()
            try:
                box[0] = fn(*args)
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                box[1] = e
            finally:
                done.release()
            del fn, args, box  # nothing of a finished step kept alive while idle


KERNEL_THREAD = KernelThread()


# modules of this package without Numba code (not in the cache key)
_NOT_KERNELS = ("__init__.py", "backend.py", "numpy_backend.py", "jit.py", "tensor_types.py", "warmup.py")


def numba_cache_dir() -> Path:
    """Where compiled kernels are cached: edgellm's user cache dir (see edgellm.fetch) / numba /
    a digest of this package's kernel sources. Numba checks only the file of the function it caches,
    so a change to a helper module (common.py, ir/*.py) would otherwise load stale machine code.
    The modules without compiled code of their own (_NOT_KERNELS) are left out: an edit there
    recompiles nothing."""
    import hashlib

    from edgellm.fetch import cache_dir

    digest = hashlib.sha256()
    here = Path(__file__).parent  # the package: kernels/cpu
    for src in sorted(here.rglob("*.py")):
        if src.name in _NOT_KERNELS:
            continue
        digest.update(src.relative_to(here).as_posix().encode() + b"\0" + src.read_bytes())
    return cache_dir() / "numba" / digest.hexdigest()[:16]


def use_cache_dir() -> None:
    """Point Numba's on-disk cache at numba_cache_dir() (unless NUMBA_CACHE_DIR is set). A module
    outside this package with `cache=True` functions calls it before defining them: Numba picks a
    function's cache folder when it is decorated (else: the package's __pycache__)."""
    import numba  # already imported by someone else: its config read the env too early

    if "NUMBA_CACHE_DIR" not in os.environ:
        os.environ["NUMBA_CACHE_DIR"] = str(numba_cache_dir())
        numba.config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
    # Numba's own locator names a function's folder by its source's absolute directory; ours names
    # it by the directory inside edgellm, so another checkout or venv of the same sources loads them.
    if hasattr(numba.config, "CACHE_LOCATOR_CLASSES") and not os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        from numba.core import caching

        numbas = ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator",
                  "IPythonCacheLocator", "ZipCacheLocator")  # Numba's default order
        chain = [f"{__name__}.PackageCacheLocator"] + [n for n in numbas if hasattr(caching, n)]
        os.environ["NUMBA_CACHE_LOCATOR_CLASSES"] = numba.config.CACHE_LOCATOR_CLASSES = ",".join(chain)


def _package_roots() -> dict[str, Path]:
    import edgellm

    return {"edgellm": Path(edgellm.__file__).resolve().parent, "kernels": Path(__file__).resolve().parents[1]}


def __getattr__(name: str):
    if name == "PackageCacheLocator":  # defined on first use: it subclasses a Numba class
        global PackageCacheLocator
        import numba
        from numba.core.caching import UserProvidedCacheLocator

        class PackageCacheLocator(UserProvidedCacheLocator):
            """The user-provided cache folder / the source's directory inside edgellm (numba_cache_dir
            is keyed by the sources already; Numba's stamp is a hash of the file's content)."""

            def __init__(self, py_func, py_file):
                super().__init__(py_func, py_file)
                self._cache_path = os.path.join(numba.config.CACHE_DIR, _inside_package(py_file))

            @classmethod
            def from_function(cls, py_func, py_file):
                return super().from_function(py_func, py_file) if _inside_package(py_file) else None

        return PackageCacheLocator
    raise AttributeError(name)


def _inside_package(py_file: str) -> str | None:
    """`kernels/cpu`, `edgellm/quality`...: the folder of an edgellm source; None for other files."""
    folder = Path(py_file).resolve().parent
    for name, root in _package_roots().items():
        if folder == root or root in folder.parents:
            return "/".join((name, *folder.relative_to(root).parts))
    return None


def loaded_kernels() -> int:
    """How many compiled kernel versions this process holds (compiled or loaded from the disk
    cache): it grows when a call needs a kernel (or argument types) not used before."""
    import sys

    from numba.core.registry import CPUDispatcher

    n = 0
    for name, module in list(sys.modules.items()):
        if name.startswith(_PACKAGE + ".") and module is not None:
            n += sum(len(obj.overloads) for obj in vars(module).values() if isinstance(obj, CPUDispatcher))
    return n


@contextmanager
def compile_listener(report):
    """Within the context, report(kernel_name) is called as each of this package's kernels starts
    compiling (one found in the disk cache is loaded, not compiled, and not reported; Numba's own
    helpers compiled along the way are not reported either)."""
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev):
            dispatcher = ev.data.get("dispatcher") if isinstance(ev.data, dict) else None
            func = getattr(dispatcher, "py_func", None)
            if getattr(func, "__module__", "").startswith(_PACKAGE):
                report(func.__name__)

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Listener()):
        yield


_COMPILER_LIBRARY = "libllvmlite"  # LLVM, which Numba links compiled and cached kernels with
_MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages now (they fault back in if touched)


def compiler_resident_bytes() -> int:
    """Bytes of the compiler library resident in this process and mapped by no other one (0 where
    /proc is not there): the pages release_compiler can hand back; a page another process maps
    (a parent that compiled too) stays resident whatever this one does."""
    total, current = 0, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                if line[0] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
                    current = line
                elif (line.startswith(("Private_Clean:", "Private_Dirty:")) and current is not None
                      and _COMPILER_LIBRARY in current):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


def release_compiler() -> None:
    """Hand the compiler library's resident pages back to the OS. Loading kernels (from the disk
    cache too) runs LLVM, whose code and tables then stay resident (~65 MiB) though running the
    loaded kernels never touches them; the pages are clean (mapped from the library file), so
    the kernel drops them now and reads them back only if LLVM runs again (a kernel not yet
    loaded). A no-op where madvise(MADV_PAGEOUT) is not available."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        with open("/proc/self/maps") as f:
            ranges = [line.split(" ", 1)[0] for line in f if _COMPILER_LIBRARY in line]
    except (OSError, AttributeError):
        return
    for r in ranges:
        lo, hi = (int(v, 16) for v in r.split("-"))
        madvise(lo, hi - lo, _MADV_PAGEOUT)  # EINVAL on kernels without it: nothing happens


def set_threads(n: int) -> None:
    """Number of threads the kernels use (at most the number of CPU cores Numba sees); NumPy's
    bundled OpenBLAS (the matmul products) follows when its library exposes the setter."""
    import numba

    if not 1 <= int(n) <= numba.config.NUMBA_NUM_THREADS:
        raise InvalidArgumentError(
            f"threads={n} is out of range; use 1 .. {numba.config.NUMBA_NUM_THREADS}")
    numba.set_num_threads(int(n))
    _set_blas_threads(int(n))


def _set_blas_threads(n: int) -> None:
    """openblas_set_num_threads of the OpenBLAS that NumPy loaded, if there is one to find."""
    import ctypes

    libs_dir = Path(np.__file__).parent.parent / "numpy.libs"
    for lib in sorted(libs_dir.glob("*openblas*")) if libs_dir.is_dir() else []:
        handle = ctypes.CDLL(str(lib))
        for symbol in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                       "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(handle, symbol, None)
            if setter is not None:
                setter(ctypes.c_int(n))
                return


# --- activations ------------------------------------------------------------------------------
