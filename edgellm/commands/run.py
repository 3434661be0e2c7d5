"""`edgellm run [MODEL] -p PROMPT`: stream the answer to stdout, a timing summary to stderr.
Without -p on a terminal it opens the chat UI; without -p with a pipe on stdin it reads the prompt.

The prompt is the user's message of a chat, rendered with the file's chat template, when the file
has one (an instruct model); a file without a template (a base model) completes the text as is.
`--raw` forces plain completion, `--chat` forces a chat (ChatML when the file has no template)."""
from __future__ import annotations

import argparse
import sys

from edgellm.commands.flags import (placement_kwargs, add_grammar_arguments, add_kv_type_arguments, add_model_arguments,
                                    add_sampling_arguments, add_spec_arguments, grammar_kwargs, kv_type_of,
                                    spec_kwargs)
from edgellm.sampling import MAX_TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("-p", "--prompt", default=None, metavar="PROMPT", help="prompt to complete")
    p.add_argument("-n", "--n-predict", type=int, default=MAX_TOKENS, metavar="N",
                   help=f"tokens to generate (default {MAX_TOKENS}; -1: until the context is full)")
    p.add_argument("-b", "--batch", type=int, default=512, metavar="N", help="prompt batch size (default 512)")
    add_kv_type_arguments(p)
    p.add_argument("--vram", default=None, metavar="SIZE", help="GPU memory budget for --gpu-layers auto (e.g. 4GiB)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true",
                      help="always wrap the prompt in a chat template (ChatML if the file has none)")
    form.add_argument("--raw", "--no-chat", dest="raw", action="store_true",
                      help="plain completion of the prompt, even when the file has a chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt of the chat")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop at this text (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="say how the prompt was fed (chat template or completion); print the plan and memory")
    add_sampling_arguments(p)
    add_grammar_arguments(p)
    add_spec_arguments(p)


def run(args) -> int:
    if args.prompt is None and sys.stdin.isatty() and sys.stdout.isatty():
        from edgellm.commands import chat

        return chat.run(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()

    import edgellm
    from edgellm.errors import InvalidArgumentError

    if args.n_predict < -1:
        raise InvalidArgumentError(f"-n must be >= -1 (-1: until the context is full), got {args.n_predict}")
    spec = {**spec_kwargs(args), **placement_kwargs(args)}
    constrained = grammar_kwargs(args)
    from edgellm.precompile import fetch_and_prepare

    args.kv_type = kv_type_of(args)
    from edgellm.api import flash_attn_arg

    flash_attn_arg(args.flash_attn, args.kv_type)  # a user error before the first run's compile
    # the first run of an install answers as soon as the first token's kernels are compiled (decode
    # steps run the unfused kernels, the same bits, while a worker compiles the fused one)
    path, compiling = fetch_and_prepare(args.model, gpu_layers=args.gpu_layers, kv_type=args.kv_type,
                                        verbose=args.verbose, background=True)
    model = edgellm.load(path, gpu_layers=args.gpu_layers, n_ctx=args.ctx, n_batch=args.batch,
                         threads=args.threads, vram=args.vram, kv_type=args.kv_type, quiet=False,
                         use_mmap=args.use_mmap, flash_attn=args.flash_attn, **spec)
    if args.verbose:
        print_plan(model, sys.stderr)
    prompt, form = prompt_text(model, prompt, chat=args.chat, raw=args.raw, system=args.system)
    if args.verbose:
        n = len(model._prompt_ids(prompt))  # a prompt too long for the context: that error now
        print(f"edgellm: prompt: {form} ({n} tokens)", file=sys.stderr)
    max_tokens = args.n_predict if args.n_predict >= 0 else model.n_ctx
    out = sys.stdout
    line_open = False  # the answer so far ends mid-line
    try:
        for chunk in model.generate(prompt, max_tokens=max_tokens, temperature=args.temp, top_k=args.top_k,
                                    top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                                    seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                                    **constrained):
            if chunk.text:
                out.write(chunk.text)
                out.flush()
                line_open = not chunk.text.endswith("\n")
    except KeyboardInterrupt:  # end the partial answer's line: "interrupted" goes on a line of its own
        if line_open:
            out.write("\n")
            out.flush()
        raise
    out.write("\n")
    out.flush()
    print(summary(model.stats), file=sys.stderr)
    if compiling is not None:  # the next runs find the fused kernel in the cache
        compiling.wait(sys.stderr, args.verbose)
    return 0


def prompt_text(model, prompt: str, *, chat: bool, raw: bool, system: str | None) -> tuple[str, str]:
    """(the text to feed, how it was made). A chat when the file has a template (or --chat), the
    prompt as the user's message and --system as the system prompt; otherwise the prompt as is."""
    has_template = bool(model.metadata.get("tokenizer.chat_template"))
    if raw or not (chat or has_template):
        if system:
            from edgellm.errors import InvalidArgumentError

            raise InvalidArgumentError("--system needs a chat; drop --raw, or pass --chat for a model "
                                       "without a chat template")
        why = "--raw" if raw else "the file has no chat template"
        return prompt, f"plain completion ({why})"
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt.rstrip("\n")})
    form = "the file's chat template" if has_template else "ChatML (--chat; the file has no template)"
    return model.render_chat(messages), f"chat, {form}"


def summary(s) -> str:
    devices = "  ".join(f"{d} {ms:.1f}" for d, ms in s.device_ms.items())
    return (f"\nprompt {s.prompt_tokens} tok, {s.prompt_tps:.1f} tok/s | generated {s.gen_tokens} tok, "
            f"{s.gen_tps:.1f} tok/s, {s.tpot_ms:.1f} ms/token | ttft {s.ttft_s * 1000:.0f} ms"
            + (f" | ms/token: {devices}" if devices else "")
            + (f" ({s.crossings} crossings a token)" if getattr(s, "crossings", 0) else "")
            + (f" | draft {s.draft_n_accepted}/{s.draft_n} accepted" if getattr(s, "draft_n", 0) else ""))


def print_plan(model, f) -> None:
    from edgellm.memory import format_size

    p = model.plan
    print(f"plan: {p.layer_map()}" + (f"; experts: {p.expert_map()}" if p.split_layers else ""), file=f)
    measured = model.memory()
    for dev, ledger in p.devices.items():
        if dev not in measured and not ledger.weights:
            continue
        m = measured.get(dev, {})
        print(f"  {dev}: weights est {format_size(ledger.weights)} / measured {format_size(m.get('weights', 0))}; "
              f"kv est {format_size(ledger.kv_cache)} / measured {format_size(m.get('kv_cache', 0))}; "
              f"activations est {format_size(ledger.activations)}; runtime est {format_size(ledger.runtime)}", file=f)
        if "draft_weights" in m:
            print(f"  {dev}: draft model est {format_size(ledger.draft)} (weights, kv, activations) / measured "
                  f"weights {format_size(m['draft_weights'])}, kv {format_size(m['draft_kv_cache'])}", file=f)
