"""`edgellm pull NAME`: fetch a known model into the user cache dir and compile its CPU kernels
(most of them while the download runs, in worker processes; see edgellm.precompile) so that the
first `run` starts at once."""
from __future__ import annotations

import argparse

KNOWN = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")  # in step with edgellm.fetch.KNOWN_MODELS (tested)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", metavar="NAME", help="known model: " + ", ".join(KNOWN))
    p.add_argument("--no-compile", action="store_true", help="only fetch; compile the kernels on the first run")


def run(args) -> int:
    from edgellm.fetch import KNOWN_MODELS, model_path
    from edgellm.errors import ModelNotFoundError

    if args.no_compile:
        path = model_path(args.name, quiet=False)
    elif args.name not in KNOWN_MODELS:  # before anything starts: the message lists the names
        raise ModelNotFoundError(f"unknown model '{args.name}'; known: {', '.join(KNOWN_MODELS)}")
    else:
        from edgellm.precompile import fetch_and_prepare

        path, _ = fetch_and_prepare(args.name)
    print(path)
    return 0
