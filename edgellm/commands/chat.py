"""`edgellm chat [MODEL]`: the terminal chat UI. `edgellm run` without -p on a terminal ends up in
`run(args)` here too, so every attribute it reads that `run`'s parser might lack has a default."""
from __future__ import annotations

import argparse
import sys

from edgellm import sampling
from edgellm.errors import InvalidArgumentError

DEFAULT_MAX_TOKENS = sampling.CHAT_MAX_TOKENS


def gpu_layers_arg(value: str) -> int | str:
    """N | -1 (all) | auto, as `edgellm.load(gpu_layers=...)` takes it."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers, -1 (all) or 'auto', got {value!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"--gpu-layers must be >= -1, got {n}")
    return n


KV_TYPE_NAMES = ("f16", "f32", "q8_0", "q4_0")  # edgellm.kv_cache.KV_TYPES (not imported: --help stays light)


def add_kv_type_arguments(p: argparse.ArgumentParser) -> None:
    """--kv-type, and llama.cpp's -ctk/--cache-type-k and -ctv/--cache-type-v (one type for both)."""
    p.add_argument("--kv-type", choices=KV_TYPE_NAMES, default=None,
                   help="KV cache type: f16 (default), f32, q8_0 or q4_0")
    p.add_argument("-ctk", "--cache-type-k", choices=KV_TYPE_NAMES, default=None, dest="kv_type_k",
                   help="llama.cpp's name for --kv-type (K)")
    p.add_argument("-ctv", "--cache-type-v", choices=KV_TYPE_NAMES, default=None, dest="kv_type_v",
                   help="llama.cpp's name for --kv-type (V): must equal K's")


def kv_type_of(args) -> str:
    """The one KV type the flags ask for (f16 when none does)."""
    from edgellm.errors import InvalidArgumentError

    given = {t for t in (getattr(args, "kv_type", None), getattr(args, "kv_type_k", None),
                         getattr(args, "kv_type_v", None)) if t}
    if len(given) > 1:
        raise InvalidArgumentError(f"K and V caches must have the same type here (got {', '.join(sorted(given))}); "
                                   "pass one of --kv-type / -ctk / -ctv")
    return given.pop() if given else "f16"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Model and offload flags shared with `edgellm run`."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="GGUF file or known model name (default: the default model, fetched on first use)")
    parser.add_argument("--gpu-layers", "-ngl", type=gpu_layers_arg, default=0, metavar="N|auto|-1",
                        help="transformer blocks to run on the GPU (-1: all, auto: as many as fit; default 0)")
    parser.add_argument("-c", "--ctx", type=int, default=4096, metavar="N", help="context size in tokens")
    parser.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    mm = parser.add_mutually_exclusive_group()
    mm.add_argument("--mmap", dest="use_mmap", action="store_const", const=True, default=None,
                    help="keep the weights in the file mapping (default: copied into huge pages when they fit)")
    mm.add_argument("--no-mmap", dest="use_mmap", action="store_const", const=False,
                    help="copy the CPU layers' weights into huge-page memory (faster decode)")
    add_flash_attn_argument(parser)


def add_flash_attn_argument(parser: argparse.ArgumentParser) -> None:
    """-fa/--flash-attn on|off|auto, as `edgellm.load(flash_attn=...)` takes it."""
    parser.add_argument("-fa", "--flash-attn", dest="flash_attn", choices=("on", "off", "auto"), default="off",
                        help="read an f16 KV cache as llama.cpp's CPU flash attention does (the bits of llama.cpp's "
                             "tools, whose default auto is on for the CPU); default off: llama-cpp-python's "
                             "default. A q8_0 / q4_0 cache always uses it")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temp", type=float, default=sampling.TEMPERATURE, metavar="T",
                        help=f"temperature (0: greedy; default {sampling.TEMPERATURE})")
    parser.add_argument("--top-k", type=int, default=sampling.TOP_K, metavar="K")
    parser.add_argument("--top-p", type=float, default=sampling.TOP_P, metavar="P")
    parser.add_argument("--min-p", type=float, default=sampling.MIN_P, metavar="P")
    parser.add_argument("--repeat-penalty", type=float, default=sampling.REPEAT_PENALTY, metavar="R")
    parser.add_argument("--seed", type=int, default=None, metavar="S")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("-n", "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                        help=f"longest answer in tokens (default {DEFAULT_MAX_TOKENS}; editable in the app)")
    parser.add_argument("--system", default="", metavar="TEXT", help="system prompt (editable in the app)")
    from edgellm.commands.run import add_spec_arguments

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
    from edgellm.commands.run import spec_kwargs

    spec = spec_kwargs(args)
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
