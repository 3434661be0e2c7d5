"""Command-line flags shared by the commands (`run`, `chat`, `serve`, `bench`, `plan`,
`perplexity`), with llama.cpp's names where it has them, and the load() / generate() arguments read
back from them (checked: a bad value is one error before any model loads)."""
from __future__ import annotations

import argparse

from edgellm import sampling


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
    add_placement_arguments(parser)


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """llama.cpp's placement per tensor: -ot/--override-tensor, --cpu-moe, --n-cpu-moe."""
    p.add_argument("-ot", "--override-tensor", action="append", default=[], metavar="REGEX=DEVICE",
                   dest="override_tensor",
                   help="put the tensors whose name matches REGEX on DEVICE (CPU or CUDA0); several allowed, the "
                        "first match wins. edgellm places a mixture-of-experts layer's experts (ffn_*_exps) this "
                        "way, e.g. -ot 'exps=CPU'")
    p.add_argument("--cpu-moe", "-cmoe", action="store_true",
                   help="keep every mixture-of-experts layer's experts on the CPU (the rest may go to the GPU)")
    p.add_argument("--n-cpu-moe", "-ncmoe", type=int, default=0, metavar="N",
                   help="keep the experts of the first N layers on the CPU")


def placement_kwargs(args) -> dict:
    """load()'s placement arguments from the flags (checked now: a bad regex or device is an error
    before any model loads)."""
    from edgellm.placement import tensor_overrides

    kw = dict(tensor_overrides=list(getattr(args, "override_tensor", None) or []),
              cpu_moe=bool(getattr(args, "cpu_moe", False)), n_cpu_moe=getattr(args, "n_cpu_moe", 0))
    tensor_overrides(kw["tensor_overrides"], cpu_moe=kw["cpu_moe"], n_cpu_moe=kw["n_cpu_moe"])
    return kw


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


def add_grammar_arguments(p: argparse.ArgumentParser) -> None:
    """Constrained output, with llama.cpp's flag names (one of them)."""
    g = p.add_argument_group("constrained output").add_mutually_exclusive_group()
    g.add_argument("--grammar", default=None, metavar="GBNF", help="the answer follows this GBNF grammar")
    g.add_argument("--grammar-file", default=None, metavar="FILE", help="... the GBNF grammar in FILE")
    g.add_argument("-j", "--json-schema", default=None, metavar="SCHEMA",
                   help="the answer is JSON valid under this JSON schema (e.g. '{}' for any JSON object)")
    g.add_argument("--json-schema-file", default=None, metavar="FILE", help="... the JSON schema in FILE")


def grammar_kwargs(args) -> dict:
    """generate()'s grammar argument from the flags (a file is read now: a missing one is an error
    before the model loads)."""
    from edgellm.errors import InvalidArgumentError

    for flag, key in (("grammar", "grammar"), ("json_schema", "json_schema")):
        text, path = getattr(args, flag, None), getattr(args, flag + "_file", None)
        if path is not None:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidArgumentError(f"--{flag.replace('_', '-')}-file {path}: cannot read it ({exc})") from None
        if text is not None:
            return {key: text}
    return {}


def add_spec_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, with llama.cpp's flag names."""
    g = p.add_argument_group("speculative decoding")
    g.add_argument("-md", "--model-draft", default=None, metavar="FILE|NAME",
                   help="a smaller model with the same vocabulary whose greedy tokens are verified "
                        "(spec type draft-simple); the same answer")
    g.add_argument("--spec-type", default=None, metavar="TYPE",
                   help="none (default), draft-simple (the default with -md) or ngram-simple: verify the tokens "
                        "that followed the latest earlier occurrence of the last n-gram (prompt lookup), the same "
                        "answer, faster on text that repeats its context")
    g.add_argument("--spec-draft-n-max", "--draft-max", "--draft", "--draft-n", type=int, default=16, metavar="N",
                   help="the most tokens proposed in a step (default 16)")
    g.add_argument("--spec-draft-n-min", "--draft-min", "--draft-n-min", type=int, default=0, metavar="N",
                   help="a shorter proposal is not verified (default 0)")
    g.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=0.75, metavar="P",
                   help="a draft model stops proposing after a token it gives less probability (default 0.75)")
    g.add_argument("--spec-ngram-simple-size-n", type=int, default=3, metavar="N",
                   help="the longest n-gram looked up (default 3)")
    g.add_argument("--spec-ngram-simple-size-m", type=int, default=16, metavar="N",
                   help="the most tokens copied after a match (default 16)")


def spec_kwargs(args) -> dict:
    """load()'s speculative decoding arguments from the flags (checked: a bad value is an error now)."""
    from edgellm.api import spec_params
    from edgellm.errors import InvalidArgumentError

    draft = getattr(args, "model_draft", None)
    spec_type = getattr(args, "spec_type", None) or ("draft-simple" if draft else "none")
    kw = dict(spec_type=spec_type, spec_draft_n_max=getattr(args, "spec_draft_n_max", 16),
              spec_draft_n_min=getattr(args, "spec_draft_n_min", 0),
              spec_ngram_size_n=getattr(args, "spec_ngram_simple_size_n", 3),
              spec_ngram_size_m=getattr(args, "spec_ngram_simple_size_m", 16),
              spec_draft_p_min=getattr(args, "spec_draft_p_min", 0.75))
    spec_params(*kw.values())
    if spec_type == "draft-simple" and not draft:
        raise InvalidArgumentError("--spec-type draft-simple needs a draft model: -md/--model-draft FILE")
    if draft and spec_type != "draft-simple":
        raise InvalidArgumentError(f"-md/--model-draft drafts with --spec-type draft-simple, not {spec_type}")
    return {**kw, "draft": draft} if draft else kw
