"""How close is a hybrid (GPU layers) run to the CPU-only run? Teacher-forced logits of a prompt on
the real models, CPU-only vs `gpu_layers` in a list: top-1 agreement and KL(cpu || gpu) per position.
Runs on a GPU, or without one under EDGELLM_CUDA_EMULATE=1 (the CUDA kernels on the CPU; slow).

    EDGELLM_CUDA_EMULATE=1 python scripts/checks/cuda_kl.py                  # both models, 1 / half / all
    EDGELLM_CUDA_EMULATE=1 python scripts/checks/cuda_kl.py --models gemma3 --gpu-layers all \\
        --cpu-ops attention,gelu_mul           # those GPU ops replaced by the CPU backend's twins
    EDGELLM_CUDA_EMULATE=1 python scripts/checks/cuda_kl.py --float-activations    # GPU products in float32
    EDGELLM_CUDA_EMULATE=1 python scripts/checks/cuda_kl.py --greedy 16   # + greedy continuations of 5 prompts
    EDGELLM_CUDA_EMULATE=1 python scripts/checks/cuda_kl.py --kv-type q8_0 --gpu-layers half  # q8_0 cache, both
    python scripts/checks/cuda_kl.py --gpu-layers 0 --batch 5   # the CPU against itself, prompt in batches of 5

--cpu-ops finds where a remaining difference comes from: each named CudaBackend op is computed by
NumpyBackend (the CPU backend's NumPy twin: ggml's roundings, e.g. attention probabilities rounded to
the cache type, GELU from ggml's f16 table) on host copies of its operands, so the KL that is left
is what the other ops contribute. --float-activations gives the GPU products float32 activations
(CudaBackend(q8_activations=False)) instead of the CPU's 8-bit blocks. --batch N evaluates the
compared run's prompt N tokens at a time (the CPU-only run's spread between batch sizes is the scale
a hybrid run's differences are measured on: kernels of another float order give another result).
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years, presses "
          "in more than two hundred European cities had produced millions of books, and the price of a "
          "book fell so far that")
MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}  # edgellm.fetch names
GREEDY_PROMPTS = ("The capital of France is", "Once upon a time, a little fox", "def fibonacci(n):",
                  "Water boils at a temperature of", "The three primary colors are")
HOST_OPS = ("attention", "rms_norm", "gelu_mul", "silu_mul", "rope")


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def compare(cpu: np.ndarray, gpu: np.ndarray) -> dict:
    """top-1 agreement, mean and max KL(cpu || gpu) over positions, max |logit difference|."""
    lp, lq = log_softmax(cpu), log_softmax(gpu)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return dict(top1=float(np.mean(cpu.argmax(-1) == gpu.argmax(-1))), kl=float(kl.mean()), kl_max=float(kl.max()),
                dlogit=float(np.abs(cpu - gpu).max()))


def greedy(m, prompt: str, n: int) -> list[int]:
    return [c.token for c in m.generate(m.tokenize(prompt), max_tokens=n, temperature=0, ignore_eos=True)]


def use_host_ops(names: list[str]) -> None:
    """Replace CudaBackend ops by the NumPy twins of the CPU backend, run on host copies."""
    from edgellm.kernels.cpu.numpy_backend import NumpyBackend
    from edgellm.kernels.cuda import backend as cuda_backend

    twin = NumpyBackend()
    cls = cuda_backend.CudaBackend

    def host(a):
        return None if a is None else a.get()

    for name in names:
        if name not in HOST_OPS:
            raise SystemExit(f"--cpu-ops: unknown op {name!r}; choose from {', '.join(HOST_OPS)}")
        if name == "attention":
            def attend(self, q, k, v, kpos_d, used, pos, window, scale, out):
                o = np.empty(out.shape, np.float32)
                twin._attend(q.get(), k.get()[:used], v.get()[:used], kpos_d.get()[:used], np.asarray(pos), window,
                             scale, o)
                out.set(o)
            cls._attend = attend
        elif name == "rms_norm":
            def rms_norm(self, x, w, eps, out):
                o = np.empty(x.shape, np.float32)
                twin.rms_norm(host(x), host(w), eps, o)
                out.set(o.reshape(out.shape))
            cls.rms_norm = rms_norm
        elif name == "rope":
            def rope(self, x, pos, n_rot, freq_base, freq_scale, neox, freq_factors=None):
                assert freq_factors is None, "--cpu-ops rope: freq_factors are not passed to the twin"
                h = x.get()
                twin.rope(h, np.asarray(pos), n_rot, freq_base, freq_scale, neox)
                x.set(h)
            cls.rope = rope
        else:
            def act(self, gate, up, out, _name=name):
                o = np.empty(gate.shape, np.float32)
                getattr(twin, _name)(gate.get(), up.get(), o)
                out.set(o)
            setattr(cls, name, act)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--gpu-layers", default="1,half,all", help="comma list of N, half, all")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--cpu-ops", default="", help=f"comma list of {', '.join(HOST_OPS)}")
    ap.add_argument("--float-activations", action="store_true")
    ap.add_argument("--batch", type=int, default=256, help="prompt batch size of the compared run")
    ap.add_argument("--greedy", type=int, default=0, help="also compare greedy continuations of this many tokens")
    ap.add_argument("--kv-type", default="f16", help="KV cache type of both runs: f16, f32, q8_0, q4_0")
    args = ap.parse_args()

    import edgellm
    from edgellm.fetch import model_path
    from edgellm.kernels.cuda import backend as cuda_backend

    if args.cpu_ops:
        use_host_ops([s for s in args.cpu_ops.split(",") if s])
    if args.float_activations:
        init = cuda_backend.CudaBackend.__init__
        cuda_backend.CudaBackend.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "q8_activations": False})
    for name in args.models.split(","):
        path = str(model_path(MODELS[name]))
        kv = dict(kv_type=args.kv_type)
        cpu = edgellm.load(path, gpu_layers=0, n_ctx=256, n_batch=256, **kv)
        ids = cpu.tokenize(args.prompt)
        want = cpu.logits(ids)
        n_layer = cpu.config.n_layer
        # greedy runs on models of their own: a generate right after a long logits() call can take its
        # steps on the engine thread, where the CPU kernels run far slower
        cpu_greedy = [greedy(edgellm.load(path, gpu_layers=0, n_ctx=64, n_batch=64, **kv), p, args.greedy)
                      for p in GREEDY_PROMPTS] if args.greedy else []
        for spec in args.gpu_layers.split(","):
            n = n_layer if spec == "all" else n_layer // 2 if spec == "half" else int(spec)
            t0 = time.process_time()
            m = edgellm.load(path, gpu_layers=n, n_ctx=256, n_batch=args.batch, **kv)
            got = m.logits(ids)
            r = compare(want, got)
            line = (f"{name} gpu_layers={n:2d}/{n_layer} kv {args.kv_type} ({len(ids)} positions): top-1 {r['top1']:.4f}  mean KL "
                    f"{r['kl']:.2e}  max KL {r['kl_max']:.2e}  max |dlogit| {r['dlogit']:.3g}")
            if args.greedy:
                g = edgellm.load(path, gpu_layers=n, n_ctx=64, n_batch=64, **kv)
                same = sum(greedy(g, p, args.greedy) == want for p, want in zip(GREEDY_PROMPTS, cpu_greedy))
                line += f"  greedy {args.greedy} tokens identical on {same}/{len(GREEDY_PROMPTS)} prompts"
            print(f"{line}  [{time.process_time() - t0:.0f} s CPU]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
