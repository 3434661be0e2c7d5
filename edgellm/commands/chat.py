"""`edgellm chat [MODEL]`: the terminal chat UI. `edgellm run` without -p on a terminal ends up in
`run(args)` here too, so every attribute it reads that `run`'s parser might lack has a default."""
from __future__ import annotations

import argparse
import sys

from edgellm import sampling
from edgellm.commands.flags import (placement_kwargs, add_model_arguments, add_sampling_arguments, add_spec_arguments, kv_type_of,
                                    spec_kwargs)
from edgellm.errors import InvalidArgumentError

DEFAULT_MAX_TOKENS = sampling.CHAT_MAX_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("-n", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"longest answer in tokens (default {DEFAULT_MAX_TOKENS}; editable in the app)")
    parser.add_argument("--system", default="", metavar="TEXT", help="system prompt (editable in the app)")
    add_spec_arguments(parser)
    parser.add_argument("--resume", action="store_true", help="reopen the last kept chat")
    parser.add_argument("--no-history", action="store_true",
                        help="keep no chats (by default every chat is kept in the user data dir)")


def run(args: argparse.Namespace) -> int:
    import edgellm
    from edgellm.precompile import fetch_and_prepare
    from edgellm.tui.app import run_chat
    from edgellm.tui.session import ChatSettings

    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise InvalidArgumentError(
            "the chat UI needs a terminal (stdin and stdout); for pipes use `edgellm run -p PROMPT`")
    if args.ctx < 1:
        raise InvalidArgumentError(f"--ctx must be a positive number of tokens, got {args.ctx}")
    settings = ChatSettings(
        system_prompt=getattr(args, "system", None) or "",
        temperature=args.temp,
        top_p=args.top_p,
        max_tokens=_max_tokens(args),
        top_k=args.top_k,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    # A first-use download and the first run's kernel compile print their progress here, on the
    # plain terminal, before the UI starts; loading the file (seconds) then happens behind the app's
    # loading screen.
    if hasattr(args, "kv_type_k"):
        args.kv_type = kv_type_of(args)
    spec = {**spec_kwargs(args), **placement_kwargs(args)}
    path, compiling = fetch_and_prepare(args.model, gpu_layers=args.gpu_layers,
                                        kv_type=getattr(args, "kv_type", None) or "f16", background=True)
    load_options = {"gpu_layers": args.gpu_layers, "n_ctx": args.ctx, "threads": args.threads,
                    "use_mmap": getattr(args, "use_mmap", None), "flash_attn": getattr(args, "flash_attn", "off")}
    for flag, option in (("batch", "n_batch"), ("vram", "vram"), ("kv_type", "kv_type")):   # `run` has these
        if getattr(args, flag, None) is not None:
            load_options[option] = getattr(args, flag)
    load_options.update(spec)

    def load():
        return edgellm.load(path, **load_options)

    try:
        return run_chat(load, settings, history=not getattr(args, "no_history", False),
                        resume=getattr(args, "resume", False))
    finally:
        if compiling is not None:  # the next runs find the fused kernel in the cache
            compiling.wait(sys.stderr)


def _max_tokens(args: argparse.Namespace) -> int:
    """`chat` has --max-tokens; `run` spells it -n (dest n or n_predict); negative means no limit
    in llama.cpp, which a chat answer still needs, so fall back to the default."""
    for name in ("max_tokens", "n_predict", "n"):
        value = getattr(args, name, None)
        if value is not None and value > 0:
            return value
    return DEFAULT_MAX_TOKENS
