"""Memory ledger and layer placement, on sparse full-size files (Llama-2 7B / 13B) and the real SmolLM2."""
from __future__ import annotations

import argparse
import json
import time

import pytest
from gguf import GGMLQuantizationType as GGMLType

from edgellm.config import ModelConfig
from edgellm.errors import InvalidArgumentError, PlanError
from edgellm.gguf_file import GGUFFile, TensorInfo
from edgellm.memory import GiB, MiB, Budgets, detect_budgets, format_size, parse_size
from edgellm.planner import (
    CPU_RUNTIME_BYTES,
    GPU_RUNTIME_BYTES,
    WeightSizes,
    plan,
)
from edgellm.synthetic import write_synthetic_gguf

LLAMA2_7B = dict(arch="llama", n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000,
                 tied_output=False)
LLAMA2_13B = dict(arch="llama", n_layer=40, n_embd=5120, n_head=40, n_head_kv=40, n_ff=13824, n_vocab=32000,
                  tied_output=False)
PARAMS_7B, PARAMS_13B = 6.74e9, 13.02e9  # published parameter counts
BIG = Budgets(cpu=1 << 50, gpu=0)


@pytest.fixture(scope="module")
def sparse_models(tmp_path_factory):
    """{(shape name, type name): GGUFFile} for 7B and 13B in F16, Q8_0 and Q4_K; header only."""
    d = tmp_path_factory.mktemp("sparse")
    files = {}
    for shape_name, shape in (("7b", LLAMA2_7B), ("13b", LLAMA2_13B)):
        for t in (GGMLType.F16, GGMLType.Q8_0, GGMLType.Q4_K):
            path = write_synthetic_gguf(d / f"{shape_name}-{t.name}.gguf", ggml_type=t, sparse=True, **shape)
            files[shape_name, t.name] = GGUFFile(path)
    return files


def facts(gf):
    cfg = ModelConfig.from_gguf(gf)
    return cfg, WeightSizes.from_tensors(gf.tensors, cfg.n_layer)


@pytest.fixture(scope="module")
def smollm2():
    from edgellm.fetch import model_path

    return GGUFFile(model_path("smollm2-135m"))


@pytest.fixture(scope="module")
def gemma3():
    from edgellm.fetch import model_path

    return GGUFFile(model_path("gemma3-270m"))


# ------------------------------------------------------------------------------------ the seed's table
def test_llama2_7b_f16_weights_and_kv(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "F16"])
    p = plan(cfg, sizes, n_ctx=2048, n_seq=8, budgets=BIG)
    weights = p.cpu.weights + p.gpu.weights
    assert abs(weights / (PARAMS_7B * 2) - 1) < 0.03  # ≈ 12.6 GiB
    kv = p.cpu.kv_cache + p.gpu.kv_cache
    assert abs(kv / (8 * GiB) - 1) < 0.01  # 2 × 32 layers × 32 heads × 128 × 2048 × 8 seqs × 2 B
    assert p.n_gpu_layers == 0 and p.gpu.total == 0  # nothing on the GPU costs nothing there
    assert p.fits


@pytest.mark.parametrize("shape,params", [("7b", PARAMS_7B), ("13b", PARAMS_13B)])
def test_quant_types_scale_with_their_bits(sparse_models, shape, params):
    f16 = facts(sparse_models[shape, "F16"])[1].total
    assert abs(f16 / (params * 2) - 1) < 0.03
    for name, bits in (("Q8_0", 8.5), ("Q4_K", 4.5)):  # every row divides into blocks: no fallback types
        total = facts(sparse_models[shape, name])[1].total
        assert abs(total / f16 - bits / 16) < 0.002, (name, total / f16)


def test_llama2_13b_kv_and_f32_kv(sparse_models):
    cfg, sizes = facts(sparse_models["13b", "Q4_K"])
    f16 = plan(cfg, sizes, n_ctx=4096, n_seq=1, budgets=BIG)
    assert f16.cpu.kv_cache == 2 * 40 * 5120 * 4096 * 2  # 3.125 GiB
    f32 = plan(cfg, sizes, n_ctx=4096, n_seq=1, kv_type="f32", budgets=BIG)
    assert f32.cpu.kv_cache == 2 * f16.cpu.kv_cache


def test_activation_terms_are_the_named_buffers(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "Q4_K"])
    p = plan(cfg, sizes, n_ctx=4096, n_batch=512, gpu_layers=4, budgets=Budgets(cpu=1 << 50, gpu=1 << 40))
    cpu, gpu = dict(p.cpu.activation_buffers), dict(p.gpu.activation_buffers)
    assert gpu["attn_scores"] == 4096 * (32 * 128 * 2) * 2  # a sequence's K and V gathered (f16)
    for kv_type, per_value in (("f32", 4), ("q8_0", 34 / 32 + 4), ("q4_0", 18 / 32 + 4)):
        # a quantized cache's gathered blocks and the float32 values dequantized from them
        pk = plan(cfg, sizes, n_ctx=4096, n_batch=512, gpu_layers=4, kv_type=kv_type,
                  budgets=Budgets(cpu=1 << 50, gpu=1 << 40))
        assert dict(pk.gpu.activation_buffers)["attn_scores"] == 4096 * (32 * 128 * 2) * per_value, kv_type
    assert gpu["dequant"] == 32 << 20  # at most this much of a matrix at a time, as the backend does
    from edgellm.kernels.cuda.backend import DEQUANT_BUFFER_BYTES

    assert DEQUANT_BUFFER_BYTES == 32 << 20
    assert gpu["ffn_gate"] == gpu["ffn_up"] == 128 * 11008 * 4  # the FFN runs 128 tokens at a time
    # one row of logits per sequence (a generation's step), on the head's device and the host copy
    assert gpu["logits"] == cpu["logits"] == 1 * 32000 * 4
    p8 = plan(cfg, sizes, n_ctx=4096, n_batch=512, n_seq=8, gpu_layers=4, budgets=Budgets(cpu=1 << 50, gpu=1 << 40))
    assert dict(p8.gpu.activation_buffers)["logits"] == 8 * 32000 * 4
    assert p.gpu.activations == sum(gpu.values()) and p.cpu.activations == sum(cpu.values())
    # n_batch larger than the context: a step never holds more than n_ctx tokens
    small = plan(cfg, sizes, n_ctx=128, n_batch=512, budgets=BIG)
    assert dict(small.cpu.activation_buffers)["ffn_gate"] == 128 * 11008 * 4
    # a tail shorter than 8 tokens joins the chunk before it
    odd = plan(cfg, sizes, n_ctx=4096, n_batch=135, budgets=BIG)
    assert dict(odd.cpu.activation_buffers)["ffn_gate"] == 135 * 11008 * 4
    # the CPU attends with per-thread scratch: one row of scores and 32 lanes of head_dim sums
    assert dict(small.cpu.activation_buffers)["attn_scores"] == 64 * (128 + 32 * 128) * 4


# ------------------------------------------------------------------------------------ placement
def test_explicit_layers_put_the_head_and_last_blocks_on_the_gpu(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "Q4_K"])
    budgets = Budgets(cpu=64 * GiB, gpu=80 * GiB)
    p = plan(cfg, sizes, n_ctx=2048, gpu_layers=10, budgets=budgets)
    assert p.layers == ("cpu",) * 22 + ("gpu",) * 10 and p.output_device == "gpu"
    assert p.layer_map() == "blocks 0-21 cpu, 22-31 gpu, output gpu"
    assert p.gpu.weights == sum(sizes.blocks[22:]) + sizes.head + sizes.output_norm
    # the CPU's Q4_K matrices (rows a multiple of 8) are packed by eight there: 37 bytes per 36
    q4k = [t for n, t in sparse_models["7b", "Q4_K"].tensors.items()
           if n.startswith("blk.") and int(n.split(".")[1]) < 22 and t.qtype.ggml_type == GGMLType.Q4_K]
    assert q4k and sum(sizes.cpu_extra[:22]) == sum(t.nbytes // 36 for t in q4k)
    assert p.cpu.weights == sum(sizes.blocks[:22]) + sum(sizes.cpu_extra[:22]) + sizes.token_embd
    on_cpu = plan(cfg, sizes, n_ctx=2048, gpu_layers=0, budgets=budgets)  # the Q4_K head is packed too
    assert on_cpu.cpu.weights == p.cpu.weights + sum(sizes.blocks[22:]) + sum(sizes.cpu_extra[22:]) + (
        sizes.head + sizes.head_cpu_extra + sizes.output_norm)
    assert p.gpu.kv_cache == 10 * 2 * 4096 * 2048 * 2
    q8 = plan(cfg, sizes, n_ctx=2048, gpu_layers=10, kv_type="q8_0", budgets=budgets)  # 34 bytes per 32 values
    assert (q8.gpu.kv_cache, q8.cpu.kv_cache) == (10 * 2 * 4096 * 2048 * 34 // 32, 22 * 2 * 4096 * 2048 * 34 // 32)
    assert p.gpu.runtime == GPU_RUNTIME_BYTES
    assert plan(cfg, sizes, n_ctx=2048, gpu_layers=-1, budgets=budgets).layers == ("gpu",) * 32
    assert plan(cfg, sizes, n_ctx=2048, gpu_layers=99, budgets=budgets).n_gpu_layers == 32


def test_tied_head_on_gpu_is_a_copy_of_token_embd(smollm2):
    cfg, sizes = facts(smollm2)
    assert sizes.tied_output and sizes.head == smollm2.tensors["token_embd.weight"].nbytes
    p = plan(cfg, sizes, n_ctx=1024, gpu_layers=-1, budgets=Budgets(cpu=8 * GiB, gpu=8 * GiB))
    assert p.gpu.weights == sum(sizes.blocks) + sizes.head + sizes.output_norm
    assert p.cpu.weights == sizes.token_embd  # the embedding lookup stays on the CPU
    on_cpu = plan(cfg, sizes, n_ctx=1024, gpu_layers=0, budgets=Budgets(cpu=8 * GiB, gpu=8 * GiB))
    assert on_cpu.cpu.weights == sum(t.nbytes for t in smollm2.tensors.values())  # counted once


def test_explicit_layers_that_do_not_fit_are_refused_with_numbers(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "F16"])
    budgets = Budgets(cpu=64 * GiB, gpu=4 * GiB, gpu_source="--vram")
    with pytest.raises(PlanError) as e:
        plan(cfg, sizes, n_ctx=2048, gpu_layers=20, budgets=budgets)
    msg = str(e.value)
    assert "GPU needs" in msg and "4.00 GiB" in msg and "--gpu-layers" in msg
    p = plan(cfg, sizes, n_ctx=2048, gpu_layers=20, budgets=budgets, check=False)
    assert not p.fits and not p.gpu.fits and p.cpu.fits
    # the suggested layer count really fits
    n = int(next(r for r in p.remedies if r.startswith("--gpu-layers")).split()[1].rstrip(":"))
    assert 0 < n < 20 and plan(cfg, sizes, n_ctx=2048, gpu_layers=n, budgets=budgets).fits


def test_remedies_put_kv_first_and_each_one_works(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "Q4_K"])
    budgets = Budgets(cpu=12 * GiB, gpu=0)  # 3.6 GiB of weights fit; 16 GiB of KV at 32k ctx do not
    p = plan(cfg, sizes, n_ctx=32768, kv_type="f32", budgets=budgets, check=False)
    assert not p.fits
    assert not any(r.startswith("--kv-type") for r in p.remedies)  # f16 KV (8 GiB) alone is still too much
    ctx = int(p.remedies[0].split()[1].rstrip(":"))
    assert p.remedies[0].startswith("--ctx") and 0 < ctx < 32768 and ctx % 256 == 0
    assert plan(cfg, sizes, n_ctx=ctx, kv_type="f32", budgets=budgets).fits
    assert not plan(cfg, sizes, n_ctx=ctx + 256, kv_type="f32", budgets=budgets, check=False).fits
    with pytest.raises(PlanError, match="--ctx"):
        plan(cfg, sizes, n_ctx=32768, kv_type="f32", budgets=budgets)
    # at 8k: 8 GiB of f32 KV do not fit next to 3.6 GiB of weights, 4 GiB of f16 KV do
    p = plan(cfg, sizes, n_ctx=8192, kv_type="f32", budgets=Budgets(cpu=9 * GiB, gpu=0), check=False)
    assert p.remedies[0] == "--kv-type f16: KV cache 8.00 GiB -> 4.00 GiB" and p.remedies[1].startswith("--ctx")


def test_smaller_quant_type_is_suggested_when_weights_are_the_problem(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "F16"])
    p = plan(cfg, sizes, n_ctx=512, budgets=Budgets(cpu=10 * GiB, gpu=0), check=False)
    assert not p.fits
    quant = [r for r in p.remedies if r.startswith("a ")]
    assert quant and quant[0].startswith("a Q8_0 file")  # the largest type that fits comes first


def test_smaller_type_from_a_quality_report(sparse_models):
    """With measured types: the one closest to the base (lowest KL) among those that fit, its size
    from its measured bits per weight; none fitting: the generic table's advice."""
    from edgellm.planner import MeasuredType

    cfg, sizes = facts(sparse_models["7b", "F16"])
    measured = (MeasuredType("Q8_0", 8.6, 0.0021, 0.97, "F16"), MeasuredType("Q5_K_M", 5.9, 0.0123, 0.93, "F16"),
                MeasuredType("Q4_K_M", 4.9, 0.0110, 0.92, "F16"), MeasuredType("Q2_K", 3.0, 0.31, 0.70, "F16"))

    def advice(gib):
        p = plan(cfg, sizes, n_ctx=512, budgets=Budgets(cpu=int(gib * GiB), gpu=0), check=False, measured=measured)
        return [r for r in p.remedies if r.startswith("a ")]

    assert advice(10)[0].startswith("a Q8_0 file of this model (8.60 bits/weight, measured mean KL 0.0021 and "
                                    "top-1 agreement 97.0 % vs F16): weights 12.55 GiB -> about 6.75 GiB")
    # Q8_0 no longer fits; Q4_K_M measured closer to the base than the larger Q5_K_M: it is named
    assert advice(6)[0].startswith("a Q4_K_M file of this model (4.90 bits/weight, measured mean KL 0.0110")
    assert advice(3.5)[0].startswith("a Q2_K file of this model (3.00 bits/weight, measured mean KL 0.3100")
    # nothing measured fits, and the measured Q2_K (3.0) is not estimated again at the generic 2.625
    assert advice(3.0) == []
    measured = measured[:3]  # without a measured Q2_K: the generic estimate
    assert advice(3.0)[0].startswith("a Q2_K file of this model (2.625 bits/weight): weights 12.55 GiB -> about")


def test_auto_with_no_gpu_is_zero_layers_with_a_reason(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "Q4_K"])
    p = plan(cfg, sizes, n_ctx=2048, gpu_layers="auto", budgets=Budgets(cpu=64 * GiB, gpu=0, gpu_source="no GPU"))
    assert p.n_gpu_layers == 0 and p.output_device == "cpu" and "no GPU" in p.notes[0]


def test_smollm2_vram_sweep_grows_monotonically(smollm2):
    """--vram 1MiB .. 8GiB: 0 layers (with a reason), then the head, then the last blocks, then all."""
    cfg, sizes = facts(smollm2)
    seen = []
    sweep = [1 * MiB, *range(256 * MiB, 1536 * MiB, 4 * MiB), 2 * GiB, 4 * GiB, 8 * GiB]
    for vram in sweep:
        p = plan(cfg, sizes, n_ctx=2048, gpu_layers="auto", budgets=Budgets(cpu=16 * GiB, gpu=vram))
        assert p.gpu.total <= vram
        n = p.n_gpu_layers
        assert p.layers == ("cpu",) * (30 - n) + ("gpu",) * n  # the last n blocks
        if n:
            assert p.output_device == "gpu"  # the head went first
        seen.append((vram, n, p.output_device))
        if vram == 1 * MiB:
            assert n == 0 and p.output_device == "cpu" and "smaller than the output head" in p.notes[0]
    counts = [n for _, n, _ in seen]
    assert counts == sorted(counts), seen
    assert counts[0] == 0 and counts[-1] == 30
    assert len({n for n in counts if 0 < n < 30}) >= 10, seen  # partial splits on the way
    # one block more than auto chose would not fit
    vram, n, _ = next(s for s in seen if 0 < s[1] < 30)
    with pytest.raises(PlanError):
        plan(cfg, sizes, n_ctx=2048, gpu_layers=n + 1, budgets=Budgets(cpu=16 * GiB, gpu=vram))


def test_sliding_window_layers_hold_window_plus_batch(gemma3):
    cfg, sizes = facts(gemma3)
    assert cfg.sliding_window == 512 and sum(cfg.swa_layers) == 15
    p = plan(cfg, sizes, n_ctx=8192, n_batch=256, budgets=BIG)
    per_cell = 2 * cfg.n_head_kv * cfg.head_dim_k * 2
    # the sliding layers' pool: window + batch + the key list's alignment (32) + a partial block
    # (16), in blocks of 16; the full layers' pool: the context
    assert p.cpu.kv_cache == per_cell * (3 * 8192 + 15 * (512 + 256 + 32 + 16))
    p4 = plan(cfg, sizes, n_ctx=8192, n_batch=256, n_seq=4, budgets=BIG)
    assert p4.cpu.kv_cache == 4 * p.cpu.kv_cache
    pool = p4.to_json()["kv_pool"]
    assert [(g["window"], g["layers"]) for g in pool["groups"]] == [(0, 3), (512, 15)]
    assert sum(g["bytes"] for g in pool["groups"]) == p4.cpu.kv_cache
    assert pool["groups"][0]["blocks"] == 4 * 8192 // pool["block_size"]
    short = plan(cfg, sizes, n_ctx=600, n_batch=256, budgets=BIG)  # window + batch > n_ctx: n_ctx in blocks
    assert short.cpu.kv_cache == per_cell * 18 * 608


def test_bad_arguments(sparse_models):
    cfg, sizes = facts(sparse_models["7b", "Q4_K"])
    for kwargs in (dict(kv_type="q4"), dict(gpu_layers=-2), dict(gpu_layers="most"), dict(n_ctx=0), dict(n_seq=0)):
        with pytest.raises(InvalidArgumentError):
            plan(cfg, sizes, **{"n_ctx": 512, "budgets": BIG, **kwargs})


# ------------------------------------------------------------------------------------ memory.py
def test_sizes():
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5G") == 3 * 2**29 and parse_size("8GB") == 8 * 10**9 and parse_size("100") == 100
    for bad in ("", "four GiB", "4 XB", "-1GiB"):
        with pytest.raises(InvalidArgumentError):
            parse_size(bad)
    assert format_size(512 * MiB) == "512.0 MiB" and format_size(13 * GiB // 2) == "6.50 GiB"
    b = detect_budgets(vram="2GiB", ram="1GiB")
    assert (b.gpu, b.cpu, b.gpu_source) == (2 * GiB, GiB, "--vram")


def test_vram_budget_without_cupy_or_visible_gpu(monkeypatch):
    import importlib.util

    from edgellm import memory

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real_find_spec(name))
    assert memory.free_vram() == (0, "CuPy is not installed (pip install 'edgellm[cuda]')")
    assert detect_budgets(ram="1GiB").gpu == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert memory._visible_gpu_index() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert memory._visible_gpu_index() == 2


def test_cpu_runtime_constant_covers_a_fresh_numba_process():
    """The CPU runtime term is at least the RSS of a fresh interpreter that imported numpy and numba."""
    import subprocess
    import sys

    code = "import numpy, numba, psutil; print(psutil.Process().memory_info().rss)"
    rss = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.3 * CPU_RUNTIME_BYTES < rss < CPU_RUNTIME_BYTES


# ------------------------------------------------------------------------------------ the command
def run_plan_command(capsys, *argv):
    from edgellm.commands import plan as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    rc = command.run(parser.parse_args(list(argv)))
    return rc, capsys.readouterr().out


def test_plan_json(capsys, monkeypatch, sparse_models):
    # the plan never reads tensor data: make any access fail
    monkeypatch.setattr(TensorInfo, "data", property(lambda self: pytest.fail(f"read {self.name}")))
    path = str(sparse_models["7b", "Q4_K"].path)
    t0 = time.perf_counter()
    rc, out = run_plan_command(capsys, path, "--ctx", "2048", "--seqs", "8", "--vram", "6GiB", "--ram", "32GiB",
                               "--json")
    elapsed = time.perf_counter() - t0
    doc = json.loads(out)
    assert rc == 0 and doc["fits"] is True
    assert {"fits", "n_gpu_layers", "output_device", "layers", "devices"} <= set(doc)
    assert 0 < doc["n_gpu_layers"] < 32 and doc["output_device"] == "gpu" and len(doc["layers"]) == 32
    assert doc["layers"].count("gpu") == doc["n_gpu_layers"] and doc["layers"][-1] == "gpu"
    for dev in ("cpu", "gpu"):
        ledger = doc["devices"][dev]
        for key in ("weights", "kv_cache", "activations", "runtime", "total", "budget"):
            assert type(ledger[key]) is int, (dev, key)
        assert ledger["total"] == sum(ledger[k] for k in ("weights", "kv_cache", "activations", "runtime", "margin"))
    assert doc["devices"]["gpu"]["budget"] == 6 * GiB and doc["devices"]["cpu"]["budget"] == 32 * GiB
    assert doc["devices"]["cpu"]["kv_cache"] + doc["devices"]["gpu"]["kv_cache"] == 8 * GiB
    assert elapsed < 0.5, elapsed  # header only


def test_plan_human_output_and_exit_code(capsys, sparse_models):
    path = str(sparse_models["7b", "F16"].path)
    rc, out = run_plan_command(capsys, path, "--ctx", "2048", "--vram", "8GiB", "--ram", "64GiB", "-ngl", "10")
    assert rc == 0 and "blocks 0-21 cpu, 22-31 gpu, output gpu" in out and "verdict: fits" in out
    assert "kv_cache" in out and "GiB" in out
    rc, out = run_plan_command(capsys, path, "--ctx", "2048", "--vram", "8GiB", "--ram", "64GiB", "-ngl", "32")
    assert rc == 1 and "does not fit" in out and "1. " in out


def test_make_plan_from_the_file_matches_plan(sparse_models):
    from edgellm.placement import make_plan

    gf = sparse_models["13b", "Q8_0"]
    a = make_plan(gf, n_ctx=1024, budgets=BIG)
    b = plan(*facts(gf), n_ctx=1024, budgets=BIG)
    assert a == b
