"""`edgellm bench MODEL`: llama-bench style pp (batched prompt tok/s) and tg (one-token decode tok/s)."""
from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from edgellm.commands.chat import gpu_layers_arg

    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help="GGUF file or known model name")
    p.add_argument("-p", "--n-prompt", type=int, default=512, metavar="N", help="prompt tokens (pp), default 512")
    p.add_argument("-n", "--n-gen", type=int, default=128, metavar="N", help="generated tokens (tg), default 128")
    p.add_argument("-r", "--repetitions", type=int, default=3, metavar="R", help="runs of each test, default 3")
    p.add_argument("-t", "--threads", type=int, default=None, metavar="N", help="CPU threads")
    p.add_argument("--gpu-layers", "-ngl", type=gpu_layers_arg, default=0, metavar="N|auto|-1")
    p.add_argument("-b", "--batch", type=int, default=512, metavar="N", help="prompt batch size")
    p.add_argument("--json", action="store_true", help="print JSON")


def machine() -> dict:
    import os
    import platform

    import psutil

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":")[1].split())
                    flags = " ".join(x for x in ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                 "avx512_vnni", "avx_vnni", "amx_int8") if x in have)
                    break
    except OSError:
        pass
    return {
        "cpu": platform.processor() or platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": os.cpu_count(),
        "simd": flags,
        "memory_bytes": psutil.virtual_memory().total,
    }


def run(args) -> int:
    import json
    import time

    import numpy as np

    import edgellm
    from edgellm.errors import InvalidArgumentError

    if args.n_prompt < 0 or args.n_gen < 0 or args.repetitions < 1:
        raise InvalidArgumentError("-p and -n must be >= 0 and -r >= 1")
    n_ctx = max(args.n_prompt + args.n_gen + 1, 16)
    model = edgellm.load(args.model, gpu_layers=args.gpu_layers, n_ctx=n_ctx, n_batch=args.batch,
                         threads=args.threads, quiet=False)
    rng = np.random.default_rng(0)
    results = []

    def one(kind: str, n: int):
        times, device = [], {}
        for r in range(args.repetitions + 1):  # the first run warms up (kernel compile, page cache)
            model.reset()
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
        ts = np.array(times)
        results.append({"test": f"{kind}{args.n_prompt if kind == 'pp' else args.n_gen}", "tokens_per_s": float(ts.mean()),
                        "sd": float(ts.std(ddof=1)) if len(ts) > 1 else 0.0, "runs": [float(x) for x in ts],
                        "ms_per_token_per_device": {d: float(np.mean(v)) for d, v in device.items()}})

    if args.n_prompt:
        one("pp", args.n_prompt)
    if args.n_gen:
        one("tg", args.n_gen + 1)
    info = {"model": str(model.path), "file_size": model.gf.file_size, "arch": model.config.arch,
            "threads": model.threads, "gpu_layers": model.plan.n_gpu_layers, "machine": machine(), "results": results}
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    m = info["machine"]
    print(f"machine: {m['cpu']}, {m['physical_cores']} physical / {m['logical_cores']} logical cores, "
          f"{m['memory_bytes'] / 2**30:.1f} GiB, SIMD: {m['simd']}")
    print(f"model:   {info['model']} ({info['arch']}, {info['file_size'] / 2**20:.1f} MiB), threads {info['threads']}, "
          f"gpu layers {info['gpu_layers']}")
    print(f"| {'test':>8} | {'t/s':>16} | ms/token per device")
    for r in results:
        dev = "  ".join(f"{d} {v:.2f}" for d, v in r["ms_per_token_per_device"].items())
        print(f"| {r['test']:>8} | {r['tokens_per_s']:8.2f} ± {r['sd']:5.2f} | {dev}")
    return 0
