"""Placement per tensor on mixture-of-experts files (llama.cpp's -ot, --cpu-moe, --n-cpu-moe): the
rules, the planner's ledger and `--gpu-layers auto`, and hybrid execution where a layer's attention
runs on the GPU and its experts on the CPU: on the GPU stand-in (the CPU's ops on a device of its
own: the same bits as the CPU-only run) and on the CUDA path run by the CPU executor."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from standin import StandInGPU

import edgellm
from edgellm.config import ModelConfig
from edgellm.errors import InvalidArgumentError, UnsupportedTensorTypeError
from edgellm.kernels.cpu.backend import CPUBackend
from edgellm.memory import GiB, Budgets
from edgellm.gguf_file import GGUFFile
from edgellm.placement import expert_overrides, make_plan, tensor_groups, tensor_overrides
from edgellm.planner import WeightSizes, expert_devices, layer_devices, ledgers, plan
from edgellm.synthetic import write_synthetic_gguf

N_LAYER = 4
TOKENS = [1, 45, 120, 7, 300, 22, 91, 5, 250, 17, 3, 64, 128, 33, 200, 99, 12, 8, 77, 140]
MOE = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 96}


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "moe-Q4_K.gguf"
    return write_synthetic_gguf(path, arch="qwen3moe", n_layer=N_LAYER, n_embd=256, n_head=4, n_head_kv=2,
                                n_ff=256, n_vocab=384, ggml_type=GGMLType.Q4_K, hparams=MOE, seed=3)


@pytest.fixture(scope="module")
def cpu_run(moe_path):
    with edgellm.load(moe_path, n_ctx=64, n_batch=64) as m:
        logits = m.logits(TOKENS)
        tokens = [c.token for c in m.generate(TOKENS, max_tokens=8, temperature=0, ignore_eos=True)]
    return logits, tokens


def standin_model(path, **placement):
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    gpu = StandInGPU()
    rules = tensor_overrides(placement.pop("tensor_overrides", ()), **placement)
    model = edgellm.Model(gf, cfg, gpu_layers=-1, n_ctx=64, n_batch=64, threads=None, vram="1GiB", kv_type="f16",
                          backends={"cpu": CPUBackend(), "gpu": gpu}, overrides=rules)
    return model, gpu


# --------------------------------------------------------------------------- the rules
def test_the_rules_follow_llama_cpp():
    rules = tensor_overrides(["blk\\.1\\.ffn_up_exps=CUDA0", ("exps", "cpu")], n_cpu_moe=2)
    names = {"blk.1.ffn_up_exps.weight": "gpu", "blk.1.ffn_down_exps.weight": "cpu",
             "blk.3.ffn_gate_exps.weight": "cpu", "blk.0.attn_q.weight": None}
    from edgellm.placement import override_device

    assert {n: override_device(rules, n) for n in names} == names  # the first match wins
    only_moe = tensor_overrides(n_cpu_moe=2)
    assert override_device(only_moe, "blk.1.ffn_gate_exps.weight") == "cpu"
    assert override_device(only_moe, "blk.2.ffn_gate_exps.weight") is None
    assert override_device(only_moe, "blk.11.ffn_gate_exps.weight") is None  # not blk.1's
    assert override_device(tensor_overrides(cpu_moe=True), "blk.40.ffn_down_exps.weight") == "cpu"


@pytest.mark.parametrize("kw, words", [
    ({"overrides": ["exps[=CPU"]}, "does not compile"),
    ({"overrides": ["exps=GPU0"]}, "unknown device 'GPU0'"),
    ({"overrides": ["exps"]}, "REGEX=DEVICE"),
    ({"overrides": [("exps", "cpu", 1)]}, "REGEX=DEVICE"),
    ({"n_cpu_moe": -1}, "n_cpu_moe"),
    ({"n_cpu_moe": 1.5}, "n_cpu_moe"),
])
def test_a_bad_rule_is_one_clear_error(kw, words):
    with pytest.raises(InvalidArgumentError, match=words):
        tensor_overrides(kw.pop("overrides", ()), **kw)


def test_rules_place_experts_only(moe_path):
    gf = GGUFFile(moe_path)
    cfg = ModelConfig.from_gguf(gf)
    assert expert_overrides(gf, cfg, tensor_overrides(n_cpu_moe=3)) == {0: "cpu", 1: "cpu", 2: "cpu"}
    with pytest.raises(InvalidArgumentError, match="blk.0.attn_q.weight.*ffn_\\*_exps"):
        expert_overrides(gf, cfg, tensor_overrides(["attn_q=CPU"]))
    with pytest.raises(InvalidArgumentError, match="block 1's expert tensors on two devices"):
        expert_overrides(gf, cfg, tensor_overrides(["blk\\.1\\.ffn_up_exps=CUDA0", "exps=CPU"]))


# --------------------------------------------------------------------------- hybrid execution
@pytest.mark.parametrize("placement, experts", [
    ({"cpu_moe": True}, ("cpu",) * N_LAYER),
    ({"n_cpu_moe": 2}, ("cpu", "cpu", "gpu", "gpu")),
    ({"tensor_overrides": ["blk\\.[13]\\.ffn_.*_exps=CPU"]}, ("gpu", "cpu", "gpu", "cpu")),
])
def test_experts_on_the_cpu_beside_gpu_attention(moe_path, cpu_run, placement, experts):
    """Every block on the GPU stand-in with its experts where the rules say: the CPU's experts give
    the CPU-only run's bits, the stand-in's (one product per used expert) its values within float
    rounding; the same greedy tokens; each device's weights are the plan's, the stand-in holds what
    was uploaded; a decode step crosses in once and twice per layer (the routing runs on the host)."""
    want_logits, want_tokens = cpu_run
    model, gpu = standin_model(moe_path, **placement)
    assert model.plan.layers == ("gpu",) * N_LAYER and model.plan.experts == experts
    logits = model.logits(TOKENS)
    if "gpu" in experts:
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-4 * np.abs(want_logits).max())
    else:
        np.testing.assert_array_equal(logits, want_logits)
    tokens = [c.token for c in model.generate(TOKENS, max_tokens=8, temperature=0, ignore_eos=True)]
    assert tokens == want_tokens
    mem = model.memory()
    assert mem["gpu"]["weights"] == model.plan.gpu.weights == gpu.uploaded
    assert mem["cpu"]["weights"] == model.plan.cpu.weights
    st = model.stats
    assert st.crossings == 1 + 2 * N_LAYER  # in; out to the host's routing and back, per layer
    assert st.device_ms["cpu"] > 0 and st.device_ms["gpu"] > 0 and st.device_ms["transfer"] > 0
    model.close()


def test_experts_on_the_gpu_beside_cpu_attention(moe_path, cpu_run):
    """-ot exps=CUDA0 with no GPU layers: only the experts on the stand-in; the head stays on the CPU."""
    want_logits, want_tokens = cpu_run
    gf = GGUFFile(moe_path)
    model = edgellm.Model(gf, ModelConfig.from_gguf(gf), gpu_layers=0, n_ctx=64, n_batch=64,
                          threads=None, vram="1GiB", kv_type="f16", backends={"cpu": CPUBackend(), "gpu": StandInGPU()},
                          overrides=tensor_overrides(["exps=CUDA0"]))
    assert model.plan.layers == ("cpu",) * N_LAYER and model.plan.experts == ("gpu",) * N_LAYER
    assert model.plan.output_device == "cpu"
    np.testing.assert_allclose(model.logits(TOKENS), want_logits, rtol=1e-4, atol=1e-4 * np.abs(want_logits).max())
    experts = sum(t.nbytes for n, t in gf.tensors.items() if "_exps" in n)
    assert model.memory()["gpu"]["weights"] == model.plan.gpu.weights == experts
    model.close()


def test_n_cpu_moe_on_a_dense_model_is_a_warning(tmp_path, capfd):
    path = write_synthetic_gguf(tmp_path / "dense.gguf", arch="llama", n_layer=1, n_embd=64, n_head=2, n_head_kv=1,
                                n_ff=128, n_vocab=384, ggml_type=GGMLType.Q8_0)
    with edgellm.load(path, n_cpu_moe=4, quiet=False) as m:
        assert m.plan.experts == ()
    assert "warning: --n-cpu-moe: dense.gguf has no mixture-of-experts layers; ignored" in capfd.readouterr().err


# --------------------------------------------------------------------------- the plan
@pytest.fixture(scope="module")
def full_shape(tmp_path_factory):
    """Qwen3-30B-A3B's full shape (48 layers, 128 experts of 768, 8 used) as a sparse Q4_K file."""
    path = tmp_path_factory.mktemp("q30b") / "qwen3-30b-a3b-shape.gguf"
    return write_synthetic_gguf(path, arch="qwen3moe", n_layer=48, n_embd=2048, n_head=32, n_head_kv=4,
                                head_dim=128, n_ff=6144, n_vocab=151936, tied_output=False, sparse=True,
                                hparams={"expert_count": 128, "expert_used_count": 8,
                                         "expert_feed_forward_length": 768})


@pytest.mark.parametrize("vram", [6, 12])
def test_auto_puts_the_dense_part_first_then_the_experts_that_fit(full_shape, vram):
    gf = GGUFFile(full_shape)
    cfg = ModelConfig.from_gguf(gf)
    sizes = WeightSizes.from_tensors(gf.tensors, cfg.n_layer)
    budgets = Budgets(cpu=64 * GiB, gpu=vram * GiB, cpu_source="test", gpu_source="test")
    p = plan(cfg, sizes, n_ctx=4096, gpu_layers="auto", budgets=budgets)
    assert p.layers == ("gpu",) * 48 and p.output_device == "gpu" and p.fits
    n_cpu = p.experts.count("cpu")
    assert 0 < n_cpu < 48 and p.experts == ("cpu",) * n_cpu + ("gpu",) * (48 - n_cpu)
    one_more = ledgers(cfg, sizes, 48, "gpu", p.shape, budgets, experts=expert_devices(p.layers, {}, n_cpu - 1))[1]
    assert p.gpu.total <= budgets.gpu < one_more.total  # the most experts that fit
    # every term per device: the weights are the tensors each holds (the router on the host)
    groups = tensor_groups(gf.tensors, p)
    assert p.gpu.weights == sum(g.get("gpu", 0) for g in groups.values())
    # the CPU packs Q4_K experts by eight: 37 bytes for every 36
    packed = sum(t.nbytes // 36 for n, t in gf.tensors.items() if "_exps" in n and int(n.split(".")[1]) < n_cpu)
    assert p.cpu.weights == sum(g.get("cpu", 0) for g in groups.values()) + packed
    assert groups["router"] == {"cpu": 48 * 128 * 2048 * 4}
    assert groups["experts"]["cpu"] == n_cpu * 3 * 128 * 768 * 2048 * 144 // 256
    assert p.gpu.kv_cache == 48 * 4096 * 2 * 4 * 128 * 2
    assert any(f"--n-cpu-moe {n_cpu}" in n for n in p.notes)


def test_the_plan_command_shows_the_groups_and_the_moe_remedy(full_shape):
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "plan", str(full_shape), "--vram", "6GiB", "--ram",
                        "64GiB", "-ngl", "-1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "experts: blocks 0-47 gpu (48 of 48 on the GPU); router on the CPU" in r.stdout
    assert "--n-cpu-moe " in r.stdout.split("in order of preference:")[1].splitlines()[1]
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "plan", str(full_shape), "--vram", "6GiB", "--ram",
                        "64GiB", "-ngl", "-1", "--cpu-moe"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "experts: blocks 0-47 cpu (0 of 48 on the GPU)" in r.stdout and "verdict: fits" in r.stdout
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "plan", str(full_shape), "-ot", "exps=GPU"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [
        "edgellm: error: --override-tensor exps=GPU: unknown device 'GPU'; use CPU or CUDA0"]


def test_a_cpu_only_architecture_keeps_its_layers(tmp_path):
    path = write_synthetic_gguf(tmp_path / "q2moe.gguf", arch="qwen2moe", n_layer=1, n_embd=64, n_head=2,
                                n_head_kv=1, n_ff=128, n_vocab=384, ggml_type=GGMLType.Q8_0)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    p = make_plan(gf, cfg, gpu_layers="auto", n_ctx=64, n_batch=64, kv_type="f16", vram=1 * GiB)
    assert p.n_gpu_layers == 0 and "qwen2moe layers run on the CPU only" in p.notes[0]
    with pytest.raises(UnsupportedTensorTypeError, match="qwen2moe"):
        make_plan(gf, cfg, gpu_layers=0, n_ctx=64, n_batch=64, kv_type="f16", vram=1 * GiB,
                  overrides=tensor_overrides(["exps=CUDA0"]))


# --------------------------------------------------------------------------- the CUDA path, emulated
def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def compare(p, q) -> tuple[float, float]:
    lp, lq = log_softmax(p), log_softmax(q)
    return float(np.mean(p.argmax(-1) == q.argmax(-1))), float((np.exp(lp) * (lp - lq)).sum(-1).mean())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA executor needs g++")
def test_cuda_path_with_cpu_experts(moe_path, cpu_run, monkeypatch):
    """The real CudaBackend (its kernels run by the CPU executor), every block on the GPU: all
    experts there, --cpu-moe, and --n-cpu-moe 2. The placements agree with the all-GPU run much more
    closely than the GPU path agrees with the CPU-only run (its attention and products' float order);
    MEASURED (this synthetic file): all-GPU vs CPU KL 3.4e-2, top-1 0.93; --cpu-moe / --n-cpu-moe vs
    all-GPU KL ~1.6e-4, top-1 1.0; CPU-only vs itself in prompt batches of 5: KL 3.0e-5."""
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE", "1")
    monkeypatch.delenv("EDGELLM_CUDA_EMULATE_VRAM", raising=False)
    want_logits, want_tokens = cpu_run
    runs = {}
    for name, kw in (("gpu", {}), ("cpu-moe", {"cpu_moe": True}), ("n-cpu-moe", {"n_cpu_moe": 2})):
        with edgellm.load(moe_path, gpu_layers=-1, n_ctx=64, n_batch=64, **kw) as m:
            logits = m.logits(TOKENS)
            tokens = [c.token for c in m.generate(TOKENS, max_tokens=3, temperature=0, ignore_eos=True)]
            runs[name] = (logits, tokens, m.stats.crossings, m.plan.experts, m.memory(), m.plan)
    top1, kl_gpu = compare(want_logits, runs["gpu"][0])
    assert top1 >= 0.85 and kl_gpu <= 0.1
    assert runs["gpu"][3] == ("gpu",) * N_LAYER and runs["cpu-moe"][3] == ("cpu",) * N_LAYER
    assert runs["n-cpu-moe"][3] == ("cpu", "cpu", "gpu", "gpu")
    for name in ("cpu-moe", "n-cpu-moe"):
        top1, kl = compare(runs["gpu"][0], runs[name][0])
        print(f"{name}: vs all-GPU top-1 {top1:.3f} KL {kl:.2e}; all-GPU vs CPU KL {kl_gpu:.2e}")
        assert top1 >= 0.95 and kl <= kl_gpu / 10
        assert runs[name][1][:2] == runs["gpu"][1][:2]
        mem, p = runs[name][4], runs[name][5]
        assert mem["gpu"]["weights"] == p.gpu.weights and mem["cpu"]["weights"] == p.cpu.weights
    assert all(run[2] == 1 + 2 * N_LAYER for run in runs.values())  # the routing runs on the host
