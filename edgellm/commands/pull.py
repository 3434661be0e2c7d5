"""`edgellm pull NAME`: fetch a known model into the user cache dir."""
from __future__ import annotations

import argparse

KNOWN = ("smollm2-135m", "gemma3-270m")  # kept in step with edgellm.fetch.KNOWN_MODELS (tested)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="known model: " + ", ".join(KNOWN))


def run(args) -> int:
    from edgellm.fetch import model_path

    path = model_path(args.name)
    print(path)
    return 0
