"""`edgellm bench MODEL`: llama-bench style pp (batched prompt tok/s) and tg (one-token decode tok/s),
optionally after -d N tokens already in the context, with the weight bandwidth each test achieved
(bytes of weights read per pass x passes/s) next to the machine's measured memory bandwidth."""
from __future__ import annotations

import argparse


from edgellm.commands.flags import placement_kwargs
from edgellm.machine import machine, machine_bandwidth, stream_bandwidth


def add_arguments(p: argparse.ArgumentParser) -> None:
    from edgellm.commands.flags import (add_flash_attn_argument, add_placement_arguments, add_spec_arguments,
                                        gpu_layers_arg)

    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF file or known model name")
    p.add_argument("-p", "--n-prompt", type=int, default=512, metavar="N", help="prompt tokens (pp), default 512")
    p.add_argument("-n", "--n-gen", type=int, default=128, metavar="N", help="generated tokens (tg), default 128")
    p.add_argument("-r", "--repetitions", type=int, default=3, metavar="R", help="runs of each test, default 3")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    p.add_argument("--gpu-layers", "-ngl", type=gpu_layers_arg, default=0, metavar="N|auto|-1")
    mm = p.add_mutually_exclusive_group()
    mm.add_argument("--mmap", dest="use_mmap", action="store_const", const=True, default=None,
                    help="keep the weights in the file mapping (default: copied into huge pages when they fit)")
    mm.add_argument("--no-mmap", dest="use_mmap", action="store_const", const=False,
                    help="copy the CPU layers' weights into huge-page memory")
    p.add_argument("-b", "--batch", type=int, default=512, metavar="N", help="prompt batch size")
    add_flash_attn_argument(p)
    add_placement_arguments(p)
    p.add_argument("-d", "--depth", type=int, default=0, metavar="N",
                   help="tokens already in the context before each test (default 0)")
    p.add_argument("--parallel", metavar="LIST", default=None,
                   help="many sequences: aggregate decode t/s of N sequences decoded together for each N "
                        "in LIST (e.g. 1,2,4,8), llama-batched-bench's S_PP / S_TG with -p prompt and -n "
                        "generated tokens per sequence")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_spec_arguments(p)  # with -md or --spec-type: plain and speculative decoding of one answer, side by side


def weight_bytes(gf, cfg=None) -> int:
    """Bytes of weights one forward pass of a token reads: every tensor but the token embeddings (one
    row of them is read), the embeddings in full when they are also the output head; of a
    mixture-of-experts tensor, the experts a token uses (cfg.extra's n_expert_used of n_expert)."""
    tensors = gf.tensors
    extra = getattr(cfg, "extra", None) or {}
    used = extra["n_expert_used"] / extra["n_expert"] if "n_expert" in extra else 1.0
    total = sum(int(t.nbytes * used) if name.endswith("_exps.weight") else t.nbytes
                for name, t in tensors.items() if name != "token_embd.weight")
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        total += tensors["token_embd.weight"].nbytes
    return total


def run(args) -> int:
    import json
    import time

    import numpy as np

    import edgellm
    from edgellm.errors import InvalidArgumentError

    if args.n_prompt < 0 or args.n_gen < 0 or args.repetitions < 1 or args.depth < 0:
        raise InvalidArgumentError("-p, -n and -d must be >= 0 and -r >= 1")
    if args.parallel is not None:
        return run_parallel(args)
    if getattr(args, "model_draft", None) or getattr(args, "spec_type", None) not in (None, "none"):
        return run_spec(args)
    n_ctx = max(args.depth + args.n_prompt + args.n_gen + 1, 16)
    model = edgellm.load(args.model, gpu_layers=args.gpu_layers, n_ctx=n_ctx, n_batch=args.batch,
                         threads=args.threads, quiet=False, use_mmap=args.use_mmap, flash_attn=args.flash_attn,
                         **placement_kwargs(args))
    rng = np.random.default_rng(0)
    results = []
    per_pass = weight_bytes(model.gf, model.config)
    depth = args.depth

    def prefill():
        model.reset()
        ctx = rng.integers(0, model.n_vocab, size=depth)
        for i in range(0, depth, model.n_batch):
            model.eval(ctx[i:i + model.n_batch])

    def one(kind: str, n: int):
        times, device = [], {}
        for r in range(args.repetitions + 1):  # the first run warms up (kernel compile, page cache)
            prefill()
            rt = model.runtime
            rt.timing.seconds.clear()
            rt.timing.tokens = 0
            ids = rng.integers(0, model.n_vocab, size=n)
            t0 = time.perf_counter()
            if kind == "pp":
                model.eval(ids)
            else:
                model.eval(ids[:1])
                rt.timing.seconds.clear()
                rt.timing.tokens = 0
                t0 = time.perf_counter()
                for tok in ids[1:]:
                    model.eval([int(tok)])
                n = n - 1
            dt = time.perf_counter() - t0
            if r:
                times.append(n / dt)
                for d, s in rt.timing.seconds.items():
                    device.setdefault(d, []).append(1000 * s / max(rt.timing.tokens, 1))
        memory = stream_bandwidth(model.threads)  # the machine's read rate now: it moves with its neighbours
        ts = np.array(times)
        passes = -(-n // model.n_batch) / n if kind == "pp" else 1.0  # forward passes per token
        name = f"{kind}{args.n_prompt if kind == 'pp' else args.n_gen}" + (f" @ d{depth}" if depth else "")
        results.append({"test": name, "tokens_per_s": float(ts.mean()),
                        "weight_gb_per_s": float(ts.mean()) * passes * per_pass / 1e9,
                        "memory_gb_per_s": memory / 1e9,
                        "sd": float(ts.std(ddof=1)) if len(ts) > 1 else 0.0, "runs": [float(x) for x in ts],
                        "ms_per_token_per_device": {d: float(np.mean(v)) for d, v in device.items()}})

    if args.n_prompt:
        one("pp", args.n_prompt)
    if args.n_gen:
        one("tg", args.n_gen + 1)
    info = {"model": str(model.path), "file_size": model.gf.file_size, "arch": model.config.arch,
            "threads": model.threads, "gpu_layers": model.plan.n_gpu_layers, "depth": depth,
            "weight_bytes_per_pass": per_pass, "machine": machine(), "results": results}
    info["machine"]["memory_gb_per_s"] = (float(np.mean([r["memory_gb_per_s"] for r in results])) if results
                                          else machine_bandwidth(model.threads) / 1e9)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = info["machine"]
    print(f"machine: {m['cpu']}, {m['physical_cores']} physical / {m['logical_cores']} logical cores, "
          f"{m['memory_bytes'] / 2**30:.1f} GiB, SIMD: {m['simd']}, memory read {m['memory_gb_per_s']:.1f} GB/s "
          f"({info['threads']} threads; measured after each test, which each % below is of)")
    print(f"model:   {info['model']} ({info['arch']}, {info['file_size'] / 2**20:.1f} MiB), threads {info['threads']}, "
          f"gpu layers {info['gpu_layers']}")
    print(f"weights read per forward pass: {per_pass / 2**20:.1f} MiB")
    print(f"| {'test':>14} | {'t/s':>16} | {'weights GB/s':>14} | ms/token per device")
    for r in results:
        dev = "  ".join(f"{d} {v:.2f}" for d, v in r["ms_per_token_per_device"].items())
        gbs = f"{r['weight_gb_per_s']:6.1f} ({100 * r['weight_gb_per_s'] / r['memory_gb_per_s']:3.0f}%)"
        print(f"| {r['test']:>14} | {r['tokens_per_s']:8.2f} ± {r['sd']:5.2f} | {gbs:>14} | {dev}")
    return 0


def run_parallel(args) -> int:
    """`bench --parallel 1,2,4,8`: one llama-batched-bench row per N, medians of -r runs."""
    import json
    import statistics

    import edgellm
    from edgellm.commands.bench_parallel import bench_parallel
    from edgellm.errors import InvalidArgumentError

    try:
        npls = [int(x) for x in args.parallel.split(",") if x.strip()]
    except ValueError:
        npls = []
    if not npls or min(npls) < 1:
        raise InvalidArgumentError(f"--parallel takes sequence counts like 1,2,4,8, got {args.parallel!r}")
    if args.n_prompt < 1 or args.n_gen < 2:
        raise InvalidArgumentError("--parallel needs -p >= 1 and -n >= 2")
    model = edgellm.load(args.model, gpu_layers=args.gpu_layers, n_ctx=args.n_prompt + args.n_gen + 16,
                         n_batch=args.batch, threads=args.threads, n_seq=max(npls), quiet=False,
                         use_mmap=args.use_mmap, flash_attn=args.flash_attn, **placement_kwargs(args))
    bench_parallel(model, max(npls), min(args.n_prompt, 16), 4)  # warm-up: every batch size's kernels
    rows = []
    for n in npls:
        runs = [bench_parallel(model, n, args.n_prompt, args.n_gen, seed=r) for r in range(args.repetitions)]
        rows.append({"npl": n, "npp": args.n_prompt, "ntg": args.n_gen,
                     "s_pp": statistics.median(r["s_pp"] for r in runs),
                     "s_tg": statistics.median(r["s_tg"] for r in runs)})
    model.close()
    if args.json:
        print(json.dumps({"parallel": rows, "threads": model.threads}, indent=2))
        return 0
    print(f"| {'npl':>4} | {'npp':>5} | {'ntg':>5} | {'S_PP t/s':>9} | {'S_TG t/s':>9} |")
    for r in rows:
        print(f"| {r['npl']:>4} | {r['npp']:>5} | {r['ntg']:>5} | {r['s_pp']:>9.1f} | {r['s_tg']:>9.1f} |")
    return 0


# the speculative test's request: code, whose answer a draft model predicts well
SPEC_ASK = "Write a Python function that checks whether a number is prime, with a docstring and tests."


def run_spec(args) -> int:
    """`bench -md DRAFT` / `bench --spec-type ngram-simple`: one greedy answer of -n tokens to a
    code request (chat template if the file has one), plain and speculative in turn, -r times each:
    decode tokens/s (median), the ratio, and the drafted / kept tokens; the answers must be equal."""
    import json
    import statistics

    import edgellm
    from edgellm.commands.flags import spec_kwargs
    from edgellm.errors import InvalidArgumentError

    spec = spec_kwargs(args)
    if args.n_gen < 2:
        raise InvalidArgumentError("a speculative bench needs -n >= 2")
    load = dict(gpu_layers=args.gpu_layers, n_ctx=max(args.n_gen + 256, 512), n_batch=args.batch,
                threads=args.threads, quiet=False, use_mmap=args.use_mmap, flash_attn=args.flash_attn,
                **placement_kwargs(args))
    plain = edgellm.load(args.model, **load)
    fast = edgellm.load(args.model, **load, **spec)
    try:
        has_template = bool(plain.metadata.get("tokenizer.chat_template"))
        prompt = plain.render_chat([{"role": "user", "content": SPEC_ASK}]) if has_template else SPEC_ASK
        runs: dict[str, list] = {"plain": [], spec["spec_type"]: []}
        want = None
        for _ in range(args.repetitions + 1):  # the first round warms both up, untimed
            for mode, m in (("plain", plain), (spec["spec_type"], fast)):
                toks = [c.token for c in m.generate(prompt, max_tokens=args.n_gen, temperature=0, cache_prompt=False)]
                want = toks if want is None else want
                if toks != want:
                    raise RuntimeError(f"the {mode} answer differs from the plain one (a bug: please report it)")
                st = m.stats
                runs[mode].append((st.gen_tps, st.draft_n, st.draft_n_accepted))
        rows = []
        for mode, rs in runs.items():
            timed = rs[1:]
            rows.append({"mode": mode, "tokens": len(want), "tg": statistics.median(r[0] for r in timed),
                         "draft_n": sum(r[1] for r in timed), "draft_n_accepted": sum(r[2] for r in timed)})
    finally:
        plain.close()
        fast.close()
    base = rows[0]["tg"]
    if args.json:
        print(json.dumps({"spec": rows, "threads": plain.threads, "draft": args.model_draft}, indent=2))
        return 0
    print(f"| {'mode':>13} | {'tokens':>6} | {'tg t/s':>8} | {'x plain':>7} | {'drafted':>8} | {'kept':>6} |")
    for r in rows:
        kept = f"{100 * r['draft_n_accepted'] / r['draft_n']:.0f} %" if r["draft_n"] else "-"
        print(f"| {r['mode']:>13} | {r['tokens']:>6} | {r['tg']:>8.1f} | {r['tg'] / base:>7.2f} | "
              f"{r['draft_n']:>8} | {kept:>6} |")
    return 0
