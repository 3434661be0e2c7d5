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
    arch = gf.metadata.get("general.architecture")
    if not cpu_only and not _cpu_only_arch(arch):
        return gpu_layers, None
    what = (f"the file holds {', '.join(cpu_only)} tensors, which run on the CPU only (no CUDA kernels yet)"
            if cpu_only else f"{arch} layers run on the CPU only, for now")
    if gpu_layers != "auto":
        raise UnsupportedTensorTypeError(f"--gpu-layers {gpu_layers}: {what}; use --gpu-layers 0")
    return 0, f"0 GPU layers: {what}"


def with_note(p, note):
    """Plan p with `note` first among its notes (p itself when note is None)."""
    return p if note is None else replace(p, notes=(note,) + p.notes)


def make_plan(gf, cfg=None, *, gpu_layers=0, n_ctx: int, n_batch: int = 512, kv_type: str = "f16", vram=None,
              ram=None, n_seq: int = 1, kv_size: int | None = None, overrides=(), check: bool = True, budgets=None,
              draft=None):
    """The plan of GGUF file gf from its header alone (the one path `load` and `edgellm plan` take):
    the file's CPU-only types and architectures, the tensor overrides' expert placement, the budgets
    (given, or `vram` / `ram` over what the machine has free). check: a plan that does not fit is a
    PlanError, and an explicit GPU layer count without a GPU (nor a --vram to plan for) a
    GPUUnavailableError; check=False returns it with fits=False (what `edgellm plan` shows).
    draft: the plan of a draft model loaded beside it, whose weights, KV cache and activations
    count on their devices (the `draft` row)."""
    from edgellm.config import ModelConfig
    from edgellm.memory import detect_budgets
    from edgellm.planner import RuntimeCosts, WeightSizes, plan
    from edgellm.quality.store import measured_types

    cfg = cfg or ModelConfig.from_gguf(gf)
    gpu_layers, note = cpu_only_gpu_layers(gf, gpu_layers)
    fixed = expert_overrides(gf, cfg, overrides)
    if "gpu" in fixed.values() and _cpu_only_arch(cfg.arch):
        raise UnsupportedTensorTypeError(f"--override-tensor: {cfg.arch} layers run on the CPU only, for now")
    wants_gpu = gpu_layers not in (0, "0") or "gpu" in fixed.values()
    if check and wants_gpu and gpu_layers != "auto" and vram is None and budgets is None:
        from edgellm.kernels.cuda import available

        ok, reason = available()
        if not ok:
            what = f"--gpu-layers {gpu_layers}" if gpu_layers not in (0, "0") else "--override-tensor ...=CUDA0"
            raise GPUUnavailableError(f"{what} needs a GPU, but {reason}")
    budgets = budgets or detect_budgets(vram=vram, ram=ram)
    sizes = WeightSizes.from_tensors(gf.tensors, cfg.n_layer)
    costs = RuntimeCosts()
    if draft is not None:
        costs = RuntimeCosts(draft_cpu=_held(draft.cpu), draft_gpu=_held(draft.gpu))
    p = plan(cfg, sizes, n_ctx=n_ctx, n_batch=n_batch, n_seq=n_seq, kv_type=kv_type, kv_size=kv_size,
             gpu_layers=gpu_layers, budgets=budgets, check=check, measured=measured_types(gf), expert_fixed=fixed,
             costs=costs)
    return with_note(p, note)


def measured_memory(model) -> dict[str, dict[str, int]]:
    """Bytes the loaded model holds, per device: its runtime's weights and KV cache
    (Runtime.memory), a draft model's as draft_* terms, and on the CPU the process RSS."""
    import psutil

    out = model.runtime.memory()
    draft = getattr(model, "draft", None)
    if draft is not None:  # a draft model's weights and KV cache (speculative decoding), its own terms
        for dev, terms in draft.runtime.memory().items():
            for term in ("weights", "kv_cache"):
                out.setdefault(dev, {"weights": 0, "kv_cache": 0})[f"draft_{term}"] = terms[term]
    rss = psutil.Process().memory_info().rss
    out["cpu"]["rss"] = rss
    # activations, interpreter, Numba, tokenizer tables: what the process holds beyond the exact
    # terms (mapped weights count once they are paged in)
    exact = sum(v for k, v in out["cpu"].items() if k in ("weights", "kv_cache", "draft_weights", "draft_kv_cache"))
    out["cpu"]["other"] = max(0, rss - exact)
    return out


# ---------------------------------------------------------------------------- placement per tensor
# llama.cpp's buffer-type names an override may give (case-insensitive), and the device they mean
OVERRIDE_DEVICES = {"cpu": "cpu", "cuda0": "gpu"}
# the tensors --cpu-moe / --n-cpu-moe keep on the CPU (llama.cpp's pattern for the expert tensors)
EXPERT_PATTERN = r"\.ffn_(up|down|gate)_(ch|)exps"


def tensor_overrides(overrides=(), *, cpu_moe: bool = False, n_cpu_moe: int = 0) -> tuple:
    """The (compiled regex, device) rules of llama.cpp's -ot/--override-tensor, --cpu-moe and
    --n-cpu-moe, in the order they apply (the first rule whose regex is found in a tensor's name
    wins): each override "REGEX=DEVICE" or (regex, device), then the expert rules. DEVICE: CPU or
    CUDA0. A regex that does not compile or an unknown device is an InvalidArgumentError."""
    import re

    from edgellm.errors import InvalidArgumentError

    if isinstance(overrides, str):
        overrides = [overrides]
    rules = []
    for ov in overrides:
        if isinstance(ov, str):
            pattern, sep, device = ov.rpartition("=")
            if not sep or not pattern:
                raise InvalidArgumentError(f"--override-tensor {ov!r}: expected REGEX=DEVICE, e.g. 'exps=CPU'")
        elif isinstance(ov, (tuple, list)) and len(ov) == 2 and all(isinstance(v, str) for v in ov):
            pattern, device = ov
        else:
            raise InvalidArgumentError(f"a tensor override is 'REGEX=DEVICE' or (regex, device), not {ov!r}")
        dev = OVERRIDE_DEVICES.get(device.strip().lower())
        if dev is None:
            raise InvalidArgumentError(f"--override-tensor {pattern}={device}: unknown device {device!r}; "
                                       f"use {' or '.join(d.upper() for d in OVERRIDE_DEVICES)}")
        try:
            rules.append((re.compile(pattern), dev))
        except re.error as exc:
            raise InvalidArgumentError(f"--override-tensor {pattern}={device}: the regex does not compile "
                                       f"({exc})") from None
    if isinstance(n_cpu_moe, bool) or not isinstance(n_cpu_moe, int) or n_cpu_moe < 0:
        raise InvalidArgumentError(f"n_cpu_moe (--n-cpu-moe) must be an integer >= 0, not {n_cpu_moe!r}")
    if cpu_moe:
        rules.append((re.compile(EXPERT_PATTERN), "cpu"))
    for il in range(n_cpu_moe):
        rules.append((re.compile(rf"blk\.{il}{EXPERT_PATTERN}"), "cpu"))
    return tuple(rules)


def override_device(rules, name: str) -> str | None:
    """The device the first matching rule gives tensor `name` (None: no rule matches)."""
    for rx, dev in rules:
        if rx.search(name):
            return dev
    return None


def expert_overrides(gf, cfg, rules) -> dict[int, str]:
    """{layer: device} for the layers whose expert tensors the rules place, from the file's tensor
    names. The rules may place only expert tensors (a layer's other tensors go with the layer:
    --gpu-layers), and a layer's expert tensors all on one device; otherwise InvalidArgumentError."""
    import re

    from edgellm.errors import InvalidArgumentError

    if not rules:
        return {}
    experts = re.compile(r"^blk\.(\d+)" + EXPERT_PATTERN)
    out: dict[int, str] = {}
    for name in gf.tensors:
        dev = override_device(rules, name)
        if dev is None:
            continue
        m = experts.search(name)
        if m is None:
            raise InvalidArgumentError(
                f"--override-tensor places {name} on {dev.upper()}: edgellm places single tensors only for "
                "a mixture-of-experts layer's experts (ffn_*_exps); a layer's other tensors follow --gpu-layers")
        il = int(m.group(1))
        if out.setdefault(il, dev) != dev:
            raise InvalidArgumentError(f"--override-tensor puts block {il}'s expert tensors on two devices; "
                                       "one device per layer's experts")
    return out


def _cpu_only_arch(arch) -> bool:
    from edgellm.errors import EdgeLLMError
    from edgellm.models import architecture

    try:
        return bool(getattr(architecture(arch).Model, "CPU_ONLY", False))
    except (EdgeLLMError, TypeError):
        return False  # an unknown architecture: refused where the model is read


def tensor_groups(tensors, p) -> dict[str, dict[str, int]]:
    """Bytes of the file's tensors per group (embeddings, attention, norms, ffn, router, experts,
    shared expert, head) and the device plan p puts them on."""
    import re

    from edgellm.planner import EXPERT_TENSORS

    out: dict[str, dict[str, int]] = {}
    blk = re.compile(r"^blk\.(\d+)\.([^.]+)")
    for name, t in tensors.items():
        m = blk.match(name)
        if m is None:
            group, dev = {"token_embd.weight": ("embeddings", "cpu"), "output.weight": ("head", p.output_device),
                          "output_norm.weight": ("norms", p.output_device)}.get(name, ("other", "cpu"))
        else:
            il, part = int(m.group(1)), m.group(2)
            if il >= len(p.layers):
                continue
            dev = p.layers[il]
            if part in EXPERT_TENSORS:
                group, dev = "experts", (p.experts[il] if p.experts else dev)
            elif part == "ffn_gate_inp" and p.experts:
                group, dev = "router", "cpu"  # the routing runs on the host
            elif part.endswith("_shexp") or part == "ffn_gate_inp_shexp":
                group = "shared expert"
            elif part.endswith("_norm"):
                group = "norms"
            elif part.startswith("attn"):
                group = "attention"
            else:
                group = "ffn"
        g = out.setdefault(group, {})
        g[dev] = g.get(dev, 0) + t.nbytes
    return out


def _held(ledger) -> int:
    """What a draft model's ledger adds beside its target: weights, KV cache, activations."""
    return ledger.weights + ledger.kv_cache + ledger.activations + ledger.draft
