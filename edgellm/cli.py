"""`edgellm` command line. Subcommands live in edgellm.commands.<name> and are imported lazily:
each module defines `add_arguments(parser)` (cheap, no heavy imports) and `run(args) -> int`."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Order is the order --help lists them.
COMMANDS = {
    "run": ("edgellm.commands.run", "generate text (-p) or open the chat UI"),
    "chat": ("edgellm.commands.chat", "open the terminal chat UI"),
    "info": ("edgellm.commands.info", "show a GGUF file's architecture, dims, tensor types and sizes"),
    "plan": ("edgellm.commands.plan", "plan CPU/GPU layer placement from the memory ledger"),
    "bench": ("edgellm.commands.bench", "measure prompt (pp) and decode (tg) speed"),
    "pull": ("edgellm.commands.pull", "fetch a known model into the cache"),
    "ls": ("edgellm.commands.ls", "list the cached models"),
    "rm": ("edgellm.commands.rm", "delete a cached model"),
    "quantize": ("edgellm.commands.quantize", "quantize a GGUF file (llama-quantize's types and recipes)"),
    "perplexity": ("edgellm.commands.perplexity", "perplexity (and KL vs a base model) over a text"),
    "quality": ("edgellm.commands.quality", "quantize to several types: size, quality and speed side by side"),
    "serve": ("edgellm.commands.serve", "serve a model over an OpenAI-compatible HTTP API"),
}


def build_parser() -> argparse.ArgumentParser:
    from edgellm import __version__

    parser = argparse.ArgumentParser(prog="edgellm", description="Run GGUF language models on modest machines.")
    parser.add_argument("--version", action="version", version=f"edgellm {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from edgellm.errors import EdgeLLMError

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    debug = getattr(args, "debug", False)
    try:
        return importlib.import_module(COMMANDS[args.command][0]).run(args) or 0
    except EdgeLLMError as exc:
        if debug:
            raise
        print(f"edgellm: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("edgellm: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
