"""`edgellm plan MODEL`: the memory ledger per device, the layer map and a verdict, from the header alone.

Exit code 0 when the plan fits, 1 when it does not (the table and the remedies are still printed).
"""
from __future__ import annotations

import argparse

from edgellm.commands.flags import add_kv_type_arguments, add_placement_arguments, gpu_layers_arg, kv_type_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="GGUF file or known model name")
    p.add_argument("-c", "--ctx", type=int, default=4096, help="context length n_ctx (default 4096)")
    p.add_argument("-b", "--batch", type=int, default=512, help="prompt batch size n_batch (default 512)")
    p.add_argument("--seqs", "-np", "--parallel", type=int, default=1, dest="seqs",
                   help="parallel sequences sharing the KV cache (default 1)")
    p.add_argument("--kv-size", type=int, default=None, metavar="TOKENS",
                   help="KV pool in tokens (default: --seqs x --ctx)")
    p.add_argument("--vram", metavar="SIZE", help="GPU budget, e.g. 4GiB (default: free VRAM; 0 without a GPU)")
    p.add_argument("--ram", metavar="SIZE", help="CPU budget, e.g. 16GiB (default: available RAM)")
    p.add_argument("-ngl", "--gpu-layers", type=gpu_layers_arg, default="auto",
                   help="blocks on the GPU: N, -1 (all) or auto (default auto)")
    add_kv_type_arguments(p)
    add_placement_arguments(p)
    p.add_argument("-md", "--model-draft", default=None, metavar="FILE|NAME",
                   help="a draft model loaded beside it (speculative decoding): its memory in the plan")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (see docs/plan-json.md)")


def resolve_model(model: str):
    """A path that exists, else a known name through edgellm.fetch."""
    from pathlib import Path

    path = Path(model).expanduser()
    if path.exists():
        return path
    from edgellm.fetch import model_path

    return model_path(model)


def run(args: argparse.Namespace) -> int:
    import json

    from edgellm.config import ModelConfig
    from edgellm.gguf_file import GGUFFile
    from edgellm.placement import make_plan, tensor_groups, tensor_overrides
    from edgellm.planner import WeightSizes

    rules = tensor_overrides(args.override_tensor, cpu_moe=args.cpu_moe, n_cpu_moe=args.n_cpu_moe)
    gf = GGUFFile(resolve_model(args.model))
    config = ModelConfig.from_gguf(gf)
    sizes = WeightSizes.from_tensors(gf.tensors, config.n_layer)
    shape = dict(n_ctx=args.ctx, n_batch=args.batch, n_seq=args.seqs, kv_type=kv_type_of(args), kv_size=args.kv_size,
                 vram=args.vram, ram=args.ram, check=False)
    draft = None
    if args.model_draft:  # planned as load() loads it: on the CPU, with the target's context
        draft = make_plan(GGUFFile(resolve_model(args.model_draft)), gpu_layers=0, **shape)
    p = make_plan(gf, config, gpu_layers=args.gpu_layers, overrides=rules, draft=draft, **shape)
    groups = tensor_groups(gf.tensors, p)
    if args.json:
        out = {"model": str(gf.path), "arch": config.arch, "n_layer": config.n_layer,
               "bits_per_weight": round(sizes.bits_per_weight, 3), **p.to_json(), "tensor_groups": groups}
        print(json.dumps(out, indent=2))
    else:
        print(render(p, config, sizes, gf.path.name, groups))
    return 0 if p.fits else 1


ROWS = ("weights", "kv_cache", "activations", "runtime", "margin", "total", "budget")


GROUPS = ("embeddings", "attention", "norms", "ffn", "router", "experts", "shared expert", "head", "other")


def render(p, config, sizes, name: str, groups: dict | None = None) -> str:
    from edgellm.memory import format_size

    s = p.shape
    lines = [
        f"{name}: {config.arch}, {config.n_layer} blocks, {format_size(sizes.total)} of weights "
        f"({sizes.bits_per_weight:.2f} bits/weight)",
        f"n_ctx {s.n_ctx}, n_batch {s.n_batch}, {s.n_seq} sequence{'s' if s.n_seq > 1 else ''}, KV {s.kv_type}",
        "",
        f"{'':<13}{'CPU':>14}{'GPU':>14}",
    ]
    for row in ROWS if not (p.cpu.draft or p.gpu.draft) else ROWS[:5] + ("draft",) + ROWS[5:]:
        lines.append(f"{row:<13}" + "".join(f"{format_size(getattr(l, row)):>14}" for l in (p.cpu, p.gpu)))
    lines.append(f"{'left':<13}" + "".join(f"{format_size(l.budget - l.total):>14}" for l in (p.cpu, p.gpu)))
    lines.append(f"budget from: CPU {p.cpu.budget_source}; GPU {p.gpu.budget_source}")
    lines += ["", f"layers: {p.layer_map()} ({p.n_gpu_layers} of {config.n_layer} blocks on the GPU)"]
    if p.experts:
        lines.append(f"experts: {p.expert_map()} ({p.experts.count('gpu')} of {config.n_layer} on the GPU); "
                     "router on the CPU")
    if groups and p.experts:  # where each group of tensors is, in bytes
        lines += ["", f"{'weights':<13}{'CPU':>14}{'GPU':>14}"]
        lines += [f"{g:<13}" + "".join(f"{format_size(groups[g].get(d, 0)):>14}" for d in ("cpu", "gpu"))
                  for g in GROUPS if g in groups]
    lines += [f"note: {n}" for n in p.notes]
    if p.fits:
        lines.append("verdict: fits")
    else:
        short = [f"{d.upper()} short by {format_size(l.total - l.budget)}" for d, l in p.devices.items() if not l.fits]
        lines.append(f"verdict: does not fit ({', '.join(short)}); any one of these would fit, in order of preference:")
        lines += [f"  {i}. {r}" for i, r in enumerate(p.remedies, 1)]
    return "\n".join(lines)
