"""`edgellm rm NAME`: delete a cached model (by name or file name, as `edgellm ls` shows it)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="a model name or file name from `edgellm ls`")


def run(args) -> int:
    from edgellm.fetch import remove_model
    from edgellm.memory import format_size

    removed = remove_model(args.name)
    print(f"removed {removed.name} ({removed.file}, {format_size(removed.size)})")
    return 0
