"""The warm-up: the steps that load (or compile) every kernel a model's steps will run, before any
weight is read, and what follows them: the compiler's memory handed back after the steps that may
have loaded kernels.

At load, `warm_up` runs one CPU layer of each kind (its tensor types and row counts, sliding window
or not, last or not) on a 9-token batch, a 3-token batch (a prompt's tail, a decode step of several
sequences) and one token, on scratch caches, reading only those layers' weights; the output head's
products run on 8 of its rows. precompile's worker processes (edgellm.precompile) run the same steps
(`python -m edgellm.kernels.cpu.warmup PATH KV_TYPE STEPS`) to fill the disk cache in parallel.
"""
from __future__ import annotations

import json
import sys

import numpy as np

from edgellm.kernels.cpu.jit import STATE

PROMPT_TOKENS = 9  # the warm-up's prompt batch: more than one group of 4/8 tokens
SEQS_TOKENS = 3  # the warm-up's short batch: a prompt's tail, a decode step of several sequences


def layer_kinds(model, cfg, layer_devices) -> dict:
    """(tensor types and rows, sliding window, last layer) -> the first CPU layer of that kind."""
    last = len(layer_devices) - 1
    kinds: dict = {}
    for il, d in enumerate(layer_devices):
        if d == "cpu":
            w = tuple((getattr(t, "ggml_type", None), getattr(t, "n_rows", None)) for t in vars(model.blocks[il]).values())
            kinds.setdefault((w, cfg.swa_layers[il], il == last), il)
    return kinds


def warm_up_steps(model, cfg, layer_devices, output_device: str, n_seq: int, fused: bool = True) -> list[tuple]:
    """The warm-up's steps: ("block", il, n_tok, last_only) for one CPU layer of each kind (a prompt
    batch; on the last layer the same batch with only its last row going on; a short batch: a
    prompt's tail or a decode step of several sequences), one token through the layers: ("layers", (il, ...), 1), one layer
    of each kind in one fused call as a decode step of an all-CPU model runs them (the kernel
    variant of all their types together), or ("block", il, 1, False) per kind when some layers are
    on the GPU (the CPU layers then decode one by one), or when `fused` is False (the fused decode
    kernel is not to be run yet: jit.STATE.fused_ready; the one-token block then runs the
    unfused kernels); with several sequences, ("mixed", il, n_tok) per kind: a token alone beside a
    batch, as a step of decode tokens and a prompt runs them; then ("head", n_tok) for the output
    head's products when they run on the CPU."""
    last = len(layer_devices) - 1
    all_cpu = all(d == "cpu" for d in layer_devices) and fused
    batches = [(PROMPT_TOKENS, False), (PROMPT_TOKENS, True)] + ([] if all_cpu else [(1, False)]) + [
        (SEQS_TOKENS, False)]
    kinds = tuple(layer_kinds(model, cfg, layer_devices).values())
    steps = []
    for il in kinds:
        for n, last_only in batches:
            if not last_only or il == last:
                steps.append(("block", il, n, last_only))
    if all_cpu and kinds:
        steps.append(("layers", kinds, 1))
    if n_seq > 1:  # a step of decode tokens beside a prompt: the one-token attention, unfused
        steps += [("mixed", il, SEQS_TOKENS) for il in kinds]
    if output_device == "cpu" and hasattr(model.output, "ggml_type"):
        steps += [("head", n) for n in (PROMPT_TOKENS, 1, SEQS_TOKENS)]
    return steps


def run_warm_up_step(step: tuple, cfg, cpu, model, kv_dtype) -> None:
    """One warm-up step on scratch buffers: blocks on 16-slot scratch caches of kv_dtype (reading
    only those layers' weights), or the head's products on 8 of its rows."""
    def scratch_kv(il):
        window = cfg.sliding_window if cfg.swa_layers[il] else 0
        return cpu.kv_layer(16, cfg.n_head_kv, cfg.head_dim_k, cfg.head_dim_v, kv_dtype, window)

    if step[0] == "block":
        _, il, n, last_only = step
        x = model.embed(np.zeros(n, np.int64))
        model.block(il, cpu, x, np.arange(n, dtype=np.int64), scratch_kv(il), rows=slice(n - 1, n) if last_only else None)
    elif step[0] == "mixed":
        _, il, n = step
        kv = scratch_kv(il)
        kv.singles = 1
        model.block(il, cpu, model.embed(np.zeros(n, np.int64)), np.arange(n, dtype=np.int64), kv)
    elif step[0] == "layers":
        _, layers, n = step
        kvs = [scratch_kv(il) for il in layers]
        pos = np.arange(n, dtype=np.int64)
        if not model.decode_all(model.embed(np.zeros(n, np.int64)), pos, kvs, layers=list(layers)):
            for il, kv in zip(layers, kvs):  # the unfused ops, layer by layer
                model.block(il, cpu, model.embed(np.zeros(n, np.int64)), pos, kv)
    else:
        _, n = step
        w = model.output
        rows = cpu.kernels.bind(w.ggml_type, w.data[:8], w.n_cols)
        if not w.data.flags.writeable:
            rows.pack()  # a mapped Q4_K head is packed by eight (CPUBackend._matrix): load those kernels
        h = np.zeros((n, cfg.n_embd), np.float32)
        cpu.rms_norm(h, model.output_norm, cfg.rms_eps, h)
        rows.matmul(h, np.empty((n, 8), np.float32))


def warm_up(cpu, model, cfg, layer_devices, output_device: str, n_seq: int, kv_dtype, on_compile=None) -> None:
    """Run the warm-up steps on backend `cpu`; on_compile(kernel_name), if given, is called as each
    kernel starts compiling (the first run of an install; later runs load them from disk). The
    one-token steps run the unfused kernels while the fused one is compiling elsewhere."""
    steps = warm_up_steps(model, cfg, layer_devices, output_device, n_seq, fused=STATE.fused_ready)
    if on_compile is not None:
        with cpu.kernels.compile_listener(on_compile):
            for step in steps:
                run_warm_up_step(step, cfg, cpu, model, kv_dtype)
    else:
        for step in steps:
            run_warm_up_step(step, cfg, cpu, model, kv_dtype)


class CompilerRelease:
    """Hands the compiler's pages back (kernels.cpu.release_compiler) after the steps that may have
    loaded kernels: the first two of each shape (sequences, tokens), and again once the fused decode
    kernel, compiling elsewhere at the warm-up, is ready (the next steps load it). Loading runs LLVM,
    whose pages would otherwise stay resident beside the weights for the whole run."""

    MAX_SHAPES = 1024  # prompt lengths vary: forget the shapes seen past this many

    def __init__(self, kernels):
        self.kernels = kernels  # the package module: its release_compiler is looked up at each call
        self.fused_pending = not STATE.fused_ready
        self._loaded = -1  # loaded kernel count at the last release
        self._seen: dict = {}

    def release(self) -> None:
        """Release the pages if kernels were loaded since the last time."""
        n = self.kernels.loaded_kernels()
        if n != self._loaded:
            self.kernels.release_compiler()
            self._loaded = n

    def after_step(self, shape: tuple) -> None:
        if self.fused_pending and STATE.fused_ready:
            self.fused_pending = False
            self._seen.clear()
        n = self._seen.get(shape, 0)
        if n < 2:
            if len(self._seen) >= self.MAX_SHAPES:
                self._seen.clear()
            self._seen[shape] = n + 1
            self.release()


def step_groups(model, cfg) -> list[list[tuple]]:
    """The warm-up steps (warm_up_steps) of an all-CPU model of one sequence, in three
    groups that compile kernels apart (as far as their argument types tell): the prompt batches
    through the layers; the one-token steps through the unfused kernels (a layer of each kind, what a
    decode step runs until the fused kernel is compiled) with the output head's products; and the
    fused decode step ("layers": every layer kind in one call), which calls the unfused step's
    kernels (attention, norms, RoPE, activation quantizers: the same argument types, so a worker
    that compiled them first finds them in the disk cache) and is needed only from the second
    token of an answer on."""
    fused = warm_up_steps(model, cfg, ["cpu"] * cfg.n_layer, "cpu", n_seq=1)
    unfused = warm_up_steps(model, cfg, ["cpu"] * cfg.n_layer, "cpu", n_seq=1, fused=False)
    prompt = [s for s in unfused if s[0] == "block" and s[2] > 1]
    one = [s for s in unfused if s not in prompt]
    return [prompt, one, [s for s in fused if s[0] == "layers"]]


def worker_shares(groups: list[list[tuple]], n_workers: int) -> list[list[tuple]]:
    """step_groups' groups over n_workers processes, each share in the order it runs: the fused
    decode step last in its share, after the steps the first token needs (so `precompile` can
    return once those are done)."""
    prompt, one, layers = groups
    if n_workers == 1:
        return [prompt + one + layers]
    return [prompt, one + layers]


def open_model(path: str, threads: int):
    """(cfg, a CPUBackend of `threads`, the model with every layer on it) of the GGUF file at path."""
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


def worker(path: str, kv_type: str, share: list) -> int:
    """Run `share`'s steps on one thread, printing "kernel NAME" as each kernel starts compiling and
    "step" after each step."""
    from edgellm.kv_cache import kv_type as _kv_type

    cfg, cpu, model = open_model(path, 1)

    def on_compile(name: str) -> None:
        print("kernel", name, flush=True)

    with cpu.kernels.compile_listener(on_compile):
        for step in share:
            step = tuple(tuple(s) if isinstance(s, list) else s for s in step)  # (JSON made the layers a list)
            # the one-token steps compile the unfused kernels (what decodes while the fused one compiles)
            (STATE.fused_compiled if step[0] == "layers" else STATE.fused_compiling)()
            run_warm_up_step(step, cfg, cpu, model, _kv_type(kv_type).kernel_dtype)
            print("step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
