"""Glue between the pure planner and a loaded model: budgets from the machine, the GPU check before
anything is allocated, and the memory the runtime really holds, per device and term."""
from __future__ import annotations

from dataclasses import replace

from edgellm.errors import GPUUnavailableError, UnsupportedTensorTypeError


def cpu_only_gpu_layers(gf, gpu_layers):
    """(gpu_layers, note) for a file with tensors of types that have no CUDA kernels yet
    (quants.CPU_ONLY_TYPES): "auto" becomes 0 with a note saying why; an explicit N > 0 or -1 is
    refused before anything is allocated. Other files: gpu_layers unchanged, note None."""
    from edgellm.quants import CPU_ONLY_TYPES

    if gpu_layers in (0, "0"):
        return gpu_layers, None
    cpu_only = sorted({t.qtype.name for t in gf.tensors.values() if t.qtype.ggml_type in CPU_ONLY_TYPES})
    if not cpu_only:
        return gpu_layers, None
    what = f"the file holds {', '.join(cpu_only)} tensors, which run on the CPU only (no CUDA kernels yet)"
    if gpu_layers != "auto":
        raise UnsupportedTensorTypeError(f"--gpu-layers {gpu_layers}: {what}; use --gpu-layers 0")
    return 0, f"0 GPU layers: {what}"


def with_note(p, note):
    """Plan p with `note` first among its notes (p itself when note is None)."""
    return p if note is None else replace(p, notes=(note,) + p.notes)


def make_plan(gf, cfg, *, gpu_layers, n_ctx: int, n_batch: int, kv_type: str, vram=None, ram=None, n_seq: int = 1,
              kv_size: int | None = None):
    from edgellm.memory import detect_budgets
    from edgellm.planner import WeightSizes, plan
    from edgellm.quality.store import measured_types

    gpu_layers, note = cpu_only_gpu_layers(gf, gpu_layers)
    wants_gpu = gpu_layers not in (0, "0")
    if wants_gpu and gpu_layers != "auto" and vram is None:
        from edgellm.kernels.cuda import available

        ok, reason = available()
        if not ok:
            raise GPUUnavailableError(f"--gpu-layers {gpu_layers} needs a GPU, but {reason}")
    budgets = detect_budgets(vram=vram, ram=ram)
    sizes = WeightSizes.from_tensors(gf.tensors, cfg.n_layer)
    p = plan(cfg, sizes, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq, kv_type=kv_type, kv_size=kv_size,
             gpu_layers=gpu_layers, budgets=budgets, check=True, measured=measured_types(gf))
    return with_note(p, note)


def measured_memory(model) -> dict[str, dict[str, int]]:
    """Bytes the loaded model holds, per device: weights placed there (mapped on the CPU, uploaded on
    the GPU), its KV cache arrays, and on the CPU the process RSS."""
    import psutil

    from edgellm.planner import WeightSizes

    rt = model.runtime
    sizes = WeightSizes.from_tensors(model.gf.tensors, len(rt.layer_devices))
    # a tied head on the CPU is the embedding already counted; anywhere else it is its own copy
    head = sizes.head if (not sizes.tied_output or rt.output_device != "cpu") else 0
    weights = _per_device(sizes, rt.layer_devices, rt.output_device, sizes.token_embd, head)
    # the CPU's Q4_K matrices packed by eight (37 bytes for every 36 of the file), once bound
    packed = getattr(rt.backends.get("cpu"), "packed_extra_bytes", None)
    if packed is not None:
        weights["cpu"] += packed()
    kv = rt.kv_bytes()
    out = {}
    for dev in sorted(set(weights) | set(kv)):
        out[dev] = {"weights": weights.get(dev, 0), "kv_cache": kv.get(dev, 0)}
    draft = getattr(model, "draft", None)
    if draft is not None:  # a draft model's weights and KV cache (speculative decoding), its own terms
        for dev, terms in measured_memory(draft).items():
            for term in ("weights", "kv_cache"):
                out.setdefault(dev, {"weights": 0, "kv_cache": 0})[f"draft_{term}"] = terms[term]
    rss = psutil.Process().memory_info().rss
    out["cpu"]["rss"] = rss
    # activations, interpreter, Numba, tokenizer tables: what the process holds beyond the exact
    # terms (mapped weights count once they are paged in)
    exact = sum(v for k, v in out["cpu"].items() if k in ("weights", "kv_cache", "draft_weights", "draft_kv_cache"))
    out["cpu"]["other"] = max(0, rss - exact)
    return out


def weights_read_per_token(model) -> dict[str, int]:
    """Bytes of weights one decode step reads on each device: the blocks placed there, the output
    norm and the whole head on the output device, other tensors on the CPU (the token embeddings
    are looked up, one row)."""
    from edgellm.planner import WeightSizes

    rt = model.runtime
    sizes = WeightSizes.from_tensors(model.gf.tensors, len(rt.layer_devices))
    return _per_device(sizes, rt.layer_devices, rt.output_device, sizes.other, sizes.head)


def _per_device(sizes, layer_devices, output_device: str, cpu_bytes: int, head: int) -> dict[str, int]:
    """cpu_bytes on the CPU, each block's bytes on its device, output norm + head on the output device."""
    out = {"cpu": cpu_bytes}
    for dev, n in zip(layer_devices, sizes.blocks):
        out[dev] = out.get(dev, 0) + n
    out[output_device] = out.get(output_device, 0) + sizes.output_norm + head
    return out
