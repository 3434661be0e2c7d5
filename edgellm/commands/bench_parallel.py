"""`edgellm bench --parallel 1,2,4,8`: aggregate decode throughput of N sequences decoded together,
measured like llama-batched-bench (npp prompt tokens per sequence, then ntg generated tokens each;
S_PP = N * npp / prompt time, S_TG = N * ntg / generation time)."""
from __future__ import annotations

import time

import numpy as np


def bench_parallel(model, npl: int, npp: int, ntg: int, seed: int = 0) -> dict:
    """One llama-batched-bench row on `model` (loaded with n_seq >= npl). Each sequence gets its own
    random prompt of npp tokens (no prefix shared); S_TG counts the ntg - 1 decode steps after the
    first token of the last sequence to start."""
    rng = np.random.default_rng(seed + npl)
    prompts = [[int(t) for t in rng.integers(100, model.n_vocab - 100, size=npp)] for _ in range(npl)]
    t0 = time.perf_counter()
    reqs = [model.submit(p, max_tokens=ntg, temperature=0, ignore_eos=True) for p in prompts]
    firsts = []
    for r in reqs:  # wait for every first token: the prompts are done
        next(r)
        firsts.append(time.perf_counter())
    t_pp = max(firsts) - t0
    t1 = time.perf_counter()
    for r in reqs:
        for _ in r:
            pass
    t_tg = time.perf_counter() - t1
    n_tg = npl * (ntg - 1)
    return {"npl": npl, "npp": npp, "ntg": ntg, "t_pp_s": t_pp, "s_pp": npl * npp / max(t_pp, 1e-9),
            "t_tg_s": t_tg, "s_tg": n_tg / max(t_tg, 1e-9), "preemptions": model.engine_stats()["preemptions"]}
