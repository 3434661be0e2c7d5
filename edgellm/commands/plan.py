"""`edgellm plan MODEL`: the memory ledger per device, the layer map and a verdict, from the header alone.

Exit code 0 when the plan fits, 1 when it does not (the table and the remedies are still printed).
"""
from __future__ import annotations

import argparse

from edgellm.commands.flags import add_kv_type_arguments, gpu_layers_arg, kv_type_of


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
    from edgellm.memory import detect_budgets
    from edgellm.placement import cpu_only_gpu_layers, with_note
    from edgellm.planner import WeightSizes, plan
    from edgellm.quality.store import measured_types

    gf = GGUFFile(resolve_model(args.model))
    config = ModelConfig.from_gguf(gf)
    sizes = WeightSizes.from_tensors(gf.tensors, config.n_layer)
    budgets = detect_budgets(vram=args.vram, ram=args.ram)
    gpu_layers, note = cpu_only_gpu_layers(gf, args.gpu_layers)
    p = with_note(plan(config, sizes, n_ctx=args.ctx, n_batch=args.batch, n_seq=args.seqs, kv_type=kv_type_of(args),
                       kv_size=args.kv_size, gpu_layers=gpu_layers, budgets=budgets, check=False,
                       measured=measured_types(gf)), note)
    if args.json:
        out = {"model": str(gf.path), "arch": config.arch, "n_layer": config.n_layer,
               "bits_per_weight": round(sizes.bits_per_weight, 3), **p.to_json()}
        print(json.dumps(out, indent=2))
    else:
        print(render(p, config, sizes, gf.path.name))
    return 0 if p.fits else 1


ROWS = ("weights", "kv_cache", "activations", "runtime", "margin", "total", "budget")


def render(p, config, sizes, name: str) -> str:
    from edgellm.memory import format_size

    s = p.shape
    lines = [
        f"{name}: {config.arch}, {config.n_layer} blocks, {format_size(sizes.total)} of weights "
        f"({sizes.bits_per_weight:.2f} bits/weight)",
        f"n_ctx {s.n_ctx}, n_batch {s.n_batch}, {s.n_seq} sequence{'s' if s.n_seq > 1 else ''}, KV {s.kv_type}",
        "",
        f"{'':<13}{'CPU':>14}{'GPU':>14}",
    ]
    for row in ROWS:
        lines.append(f"{row:<13}" + "".join(f"{format_size(getattr(l, row)):>14}" for l in (p.cpu, p.gpu)))
    lines.append(f"{'left':<13}" + "".join(f"{format_size(l.budget - l.total):>14}" for l in (p.cpu, p.gpu)))
    lines.append(f"budget from: CPU {p.cpu.budget_source}; GPU {p.gpu.budget_source}")
    lines += ["", f"layers: {p.layer_map()} ({p.n_gpu_layers} of {config.n_layer} blocks on the GPU)"]
    lines += [f"note: {n}" for n in p.notes]
    if p.fits:
        lines.append("verdict: fits")
    else:
        short = [f"{d.upper()} short by {format_size(l.total - l.budget)}" for d, l in p.devices.items() if not l.fits]
        lines.append(f"verdict: does not fit ({', '.join(short)}); any one of these would fit, in order of preference:")
        lines += [f"  {i}. {r}" for i, r in enumerate(p.remedies, 1)]
    return "\n".join(lines)
