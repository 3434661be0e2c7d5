"""`edgellm info MODEL [--json]`: what a GGUF file holds, from its header alone.

Everything shown comes from a file that may be hostile: the header is validated by
`ModelConfig.from_gguf` first, and text from it is printed escaped (`errors.printable`): no control
characters or escape sequences reach the terminal (JSON escapes them itself)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="path to a .gguf file or a known model name")
    p.add_argument("--json", action="store_true", help="print JSON (bytes as integers)")


def describe(gf) -> dict:
    from collections import Counter

    from edgellm.config import ModelConfig
    from edgellm.planner import WeightSizes

    cfg = ModelConfig.from_gguf(gf)
    md = gf.metadata
    counts, nbytes = Counter(), Counter()
    for t in gf.tensors.values():
        counts[t.qtype.name] += 1
        nbytes[t.qtype.name] += t.nbytes
    total = sum(nbytes.values())
    per_layer = list(WeightSizes.from_tensors(gf.tensors, cfg.n_layer).blocks)
    other = total - sum(per_layer)
    n_params = sum(t.n_elements for t in gf.tensors.values())
    return {
        "file": str(gf.path),
        "file_size": gf.file_size,
        "gguf_version": gf.version,
        "name": cfg.name,
        "architecture": cfg.arch,
        "n_layer": cfg.n_layer,
        "n_embd": cfg.n_embd,
        "n_head": cfg.n_head,
        "n_head_kv": cfg.n_head_kv,
        "head_dim": cfg.head_dim_k,
        "head_dim_v": cfg.head_dim_v,
        "n_ff": cfg.n_ff,
        "experts": ({"count": cfg.extra["n_expert"], "used": cfg.extra["n_expert_used"],
                     "n_ff": cfg.extra["n_ff_exp"]} if "n_expert" in cfg.extra else None),
        "n_vocab": cfg.n_vocab,
        "context_length": cfg.n_ctx_train,
        "rope": {
            "n_rot": cfg.n_rot,
            "freq_base": cfg.rope_freq_base,
            "freq_scale": cfg.rope_freq_scale,
            "freq_base_swa": cfg.rope_freq_base_swa if any(cfg.swa_layers) else None,
        },
        "sliding_window": cfg.sliding_window or None,
        "n_swa_layers": sum(cfg.swa_layers),
        "rms_eps": cfg.rms_eps,
        "tied_output": cfg.tied_output,
        "tokenizer": {
            "model": md.get("tokenizer.ggml.model"),
            "pre": md.get("tokenizer.ggml.pre"),
            "n_tokens": len(md.get("tokenizer.ggml.tokens") or ()),
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        },
        "chat_template": "tokenizer.chat_template" in md,
        "n_params": n_params,
        "n_tensors": len(gf.tensors),
        "tensor_types": {k: {"count": counts[k], "bytes": nbytes[k]} for k in sorted(counts)},
        "bytes_per_layer": per_layer,
        "bytes_other": other,
        "bytes_total": total,
        "bits_per_weight": round(8 * total / max(n_params, 1), 3),
    }


def run(args) -> int:
    import json

    from edgellm.fetch import resolve_model
    from edgellm.gguf_file import GGUFFile
    from edgellm.errors import printable
    from edgellm.memory import format_size

    gf = GGUFFile(resolve_model(args.model))
    d = describe(gf)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    r = d["rope"]
    tk = {k: printable(v) for k, v in d["tokenizer"].items()}  # text from the file: escaped, cut
    lines = [
        f"file          {printable(d['file'], None)}  ({format_size(d['file_size'])}, GGUF v{d['gguf_version']})",
        f"model         {printable(d['name'], None)}  [{printable(d['architecture'])}]  "
        f"{d['n_params'] / 1e6:.1f} M params, {d['bits_per_weight']} bits/weight",
        f"layers        {d['n_layer']}    n_embd {d['n_embd']}    n_ff {d['n_ff']}"
        + (f"    experts {d['experts']['count']} ({d['experts']['used']} used, n_ff {d['experts']['n_ff']})"
           if d["experts"] else ""),
        f"heads         {d['n_head']} q / {d['n_head_kv']} kv    head_dim {d['head_dim']}",
        f"context       {d['context_length']} (trained)",
        f"rope          n_rot {r['n_rot']}  base {r['freq_base']:g}  scale {r['freq_scale']:g}"
        + (f"  (sliding layers: base {r['freq_base_swa']:g})" if r["freq_base_swa"] else ""),
    ]
    if d["sliding_window"]:
        lines.append(f"sliding       window {d['sliding_window']} on {d['n_swa_layers']} of {d['n_layer']} layers")
    lines += [
        f"vocab         {d['n_vocab']}   tokenizer {tk['model']} (pre: {tk['pre']})   bos {tk['bos_token_id']} "
        f"eos {tk['eos_token_id']}",
        f"chat template {'yes' if d['chat_template'] else 'no (ChatML fallback)'}",
        f"output head   {'tied to token_embd' if d['tied_output'] else 'output.weight'}",
        f"tensors       {d['n_tensors']}",
    ]
    for name, v in d["tensor_types"].items():
        lines.append(f"  {name:<6} {v['count']:>5} tensors  {format_size(v['bytes']):>12}")
    per = d["bytes_per_layer"]
    if per:
        lines.append(f"per layer     {format_size(min(per))} .. {format_size(max(per))}   "
                     f"other (embedding, head, norms) {format_size(d['bytes_other'])}")
    lines.append(f"total         {format_size(d['bytes_total'])}")
    print("\n".join(lines))
    return 0
