"""`edgellm pull NAME`: fetch a known model into the user cache dir, then compile its CPU kernels
(in parallel worker processes, see edgellm.precompile) so that the first `run` starts at once."""
from __future__ import annotations

import argparse

KNOWN = ("smollm2-135m", "gemma3-270m")  # kept in step with edgellm.fetch.KNOWN_MODELS (tested)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="known model: " + ", ".join(KNOWN))
    p.add_argument("--no-compile", action="store_true", help="only fetch; compile the kernels on the first run")


def run(args) -> int:
    from edgellm.fetch import model_path

    path = model_path(args.name, quiet=False)
    if not args.no_compile:
        from edgellm.precompile import prepare

        prepare(path)
    print(path)
    return 0
