"""`edgellm ls`: the models in the cache (name, file, size, type, path)."""
from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def file_type(path) -> str:
    """The file's quantization as llama.cpp names it (general.file_type), e.g. Q4_K_M; "?" if unset."""
    from gguf import LlamaFileType

    from edgellm.errors import EdgeLLMError
    from edgellm.gguf_file import GGUFFile

    try:
        ftype = GGUFFile(path).metadata.get("general.file_type")
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    except (EdgeLLMError, ValueError, OSError):
        return "unreadable"


def run(args) -> int:
    from edgellm.fetch import cache_dir, cached_models
    from edgellm.memory import format_size

    rows = [(c.name, c.file, c.size, file_type(c.path), str(c.path)) for c in cached_models()]
    if args.json:
        print(json.dumps([dict(zip(("name", "file", "size", "type", "path"), r)) for r in rows], indent=2))
        return 0
    if not rows:
        print(f"no models in {cache_dir() / 'models'}; `edgellm pull NAME` fetches one")
        return 0
    table = [("NAME", "FILE", "SIZE", "TYPE", "PATH")] + [(n, f, format_size(s), t, p) for n, f, s, t, p in rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[4])
    return 0
