"""Every kernel the CUDA backend launches, run on the CPU by the executor through the real CudaBackend
(its grids, argument dtypes and uploads), against the NumPy twins of test_cuda_reference.py, for all
13 quant types, under two thread schedules; and the stand-in's CuPy strictness.

Needs g++ only (no CuPy, no GPU). Tolerances are those of scripts/checks/gpu_check.py: the executor runs the
kernels' own float operations in the GPU's order (same butterfly reductions), but with host libm
(a few ulp on expf/tanhf/sinf) and no FMA contraction, so results are compared with tolerances and
not bit for bit, except the pure bit decoding (dequantize) and the exact element-wise ops.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType

import test_cuda_reference as ref
from edgellm.backend import QMatrix
from edgellm.kernels.cpu.backend import CPUBackend
from edgellm.kernels.cuda.backend import QUANT_KERNELS
from edgellm.quants import QUANT_TYPES

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA executor needs g++")

SCHEDULES = ("forward", "random")  # the order runnable CUDA threads resume in (a missing barrier shows)


@pytest.fixture(params=SCHEDULES)
def gpu(request, monkeypatch):
    """A CudaBackend on the emulated device, its modules set to this schedule."""
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE", "1")
    monkeypatch.setenv("CUDAEMU_ORDER", request.param)
    monkeypatch.setenv("CUDAEMU_SEED", "7")
    planted = os.environ.get("EDGELLM_TEST_CUDA_SOURCES")  # scripts/checks/cuda_mutations.py: a mutated copy
    if planted:
        monkeypatch.setattr("edgellm.kernels.cuda.SOURCE_DIR", Path(planted))
    from edgellm.kernels.cuda.backend import CudaBackend

    return CudaBackend()


def assert_close(got, want, rtol, atol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.isfinite(got).all(), f"{int((~np.isfinite(got)).sum())} non-finite values (poisoned memory read?)"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# ============================================================================ quantized products
@pytest.mark.parametrize("ggml_type", list(QUANT_KERNELS), ids=lambda t: t.name)
def test_quant_kernels_match_numpy_twins(gpu, ggml_type, monkeypatch):
    cp, rng = gpu.cp, np.random.default_rng(int(ggml_type))
    qt = QUANT_TYPES[ggml_type]
    n_cols = 2 * 256 if qt.block_size > 1 else 300
    n_rows = 67  # not a multiple of the 4 rows of a matvec thread block: the last block is partly empty
    raw = ref.random_blocks(ggml_type, n_rows * n_cols // qt.block_size, rng).reshape(n_rows, -1)
    w_ref = ref.dequantize_ref(ggml_type, raw, n_cols)
    w = QMatrix(int(ggml_type), cp.asarray(raw), n_rows, n_cols, qt.name)

    dense = cp.empty((n_rows, n_cols), dtype=cp.float32)
    gpu.dequantize(w, dense)
    np.testing.assert_array_equal(dense.get(), w_ref)  # bit decoding and f16 scales: exact
    dense16 = cp.empty((n_rows, n_cols), dtype=cp.float16)
    gpu.dequantize(w, dense16)
    np.testing.assert_array_equal(dense16.get(), w_ref.astype(np.float16))

    # n_tok 1 and 3: a matvec kernel (decode); 7: dequantize into the reused buffer + matmul (prompt);
    # 6 with a dequantize buffer of 16 rows: W in slices of rows (67 = 4 x 16 + 3), as a big head is.
    # Quantized types: x in 8-bit blocks first (matvec_q8_*: integer dot products; prompts: d * q), the
    # twin linear_q8_ref; then the float kernels (q8_activations=False) against the float product.
    for q8 in ((True, False) if qt.block_size > 1 else (False,)):
        gpu.q8_activations = q8
        for n_tok in (1, 3, 7, 6):
            monkeypatch.setattr("edgellm.kernels.cuda.backend.DEQUANT_BUFFER_BYTES",
                                16 * 4 * n_cols if n_tok == 6 else 32 << 20)
            x = ref.hard_activations(n_tok, n_cols, rng) if q8 else rng.standard_normal((n_tok, n_cols)).astype(
                np.float32)
            out = cp.empty((n_tok, n_rows), dtype=cp.float32)
            gpu.linear(w, cp.asarray(x), out)
            got = out.get().astype(np.float64)
            if q8:
                want = ref.linear_q8_ref(ggml_type, raw, n_cols, x)
                xs = ref.requantized_ref(ref.act_format(ggml_type), x)
            else:
                want, xs = ref.linear_ref(w_ref, x).astype(np.float64), x
            bound = np.abs(xs).astype(np.float64) @ np.abs(w_ref).T.astype(np.float64)  # sum |w x| per output
            assert np.isfinite(got).all()
            assert np.max(np.abs(got - want) / bound) <= (2e-6 if q8 else 1e-5), (q8, n_tok)
    gpu.q8_activations = True

    ids = np.array([3, 0, n_rows - 1, 3])
    emb = cp.empty((len(ids), n_cols), dtype=cp.float32)
    gpu.embed(w, ids, emb)
    np.testing.assert_array_equal(emb.get(), w_ref[ids])


@pytest.mark.parametrize("fmt", ["q8_32", "q8_k"])
def test_activation_quantizers_match_numpy_twins(gpu, fmt):
    """quantize_q8_32_f32 / quantize_q8_k_f32: the CPU backend's 8-bit activations, bit for bit (zero
    blocks, ties of magnitude, round-half-even ties), with and without the float32 copy d * q."""
    cp, rng = gpu.cp, np.random.default_rng(5)
    x = ref.hard_activations(3, 768, rng)
    for write_xr in (False, True):
        xq, xd, xs, xm, xr = gpu.quantize_act(fmt, cp.asarray(x), write_xr=write_xr)
        want = ref.quantize_q8_32_ref(x.reshape(-1)) if fmt == "q8_32" else ref.quantize_q8_k_ref(x.reshape(-1))
        for got, expected in zip((xq, xd, xs, xm), want):
            np.testing.assert_array_equal(got.get(), expected)
        if write_xr:
            np.testing.assert_array_equal(xr.get(), ref.requantized_ref(fmt, x))
        else:
            assert xr is None


def test_q8_products_without_dp4a(gpu, monkeypatch):
    """Built for a device before sm_61 (no __dp4a: dot4's byte loop), the 8-bit products give the same
    bits as with __dp4a."""
    from edgellm.kernels.cuda.backend import CudaBackend

    cp, rng = gpu.cp, np.random.default_rng(6)
    cases = []
    for ggml_type in (GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q3_K, GGMLType.Q6_K):
        qt = QUANT_TYPES[ggml_type]
        raw = ref.random_blocks(ggml_type, 9 * 512 // qt.block_size, rng).reshape(9, -1)
        w = QMatrix(int(ggml_type), cp.asarray(raw), 9, 512, qt.name)
        x = cp.asarray(ref.hard_activations(2, 512, rng))
        out = cp.empty((2, 9), dtype=cp.float32)
        gpu.linear(w, x, out)  # builds gpu's modules, for sm_90
        cases.append((w, x, out.get()))
    monkeypatch.setenv("CUDAEMU_CXXFLAGS", "-DEMU_CUDA_ARCH=600")
    old = CudaBackend()  # its modules are built on first use, with the flag
    for w, x, want in cases:
        out = cp.empty((2, 9), dtype=cp.float32)
        old.linear(w, x, out)
        np.testing.assert_array_equal(out.get(), want)
    assert old._modules["quant_legacy"]._module.path != gpu._modules["quant_legacy"]._module.path


# ============================================================================ norms, rope, attention
def test_rms_norm(gpu):
    cp, rng = gpu.cp, np.random.default_rng(1)
    x = (rng.standard_normal((7, 1000)) * 3).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)
    for weight in (w, None):
        out = cp.empty(x.shape, dtype=cp.float32)
        gpu.rms_norm(cp.asarray(x), None if weight is None else cp.asarray(weight), 1e-5, out)
        assert_close(out.get(), ref.rms_norm_ref(x, weight, 1e-5), 1e-5, 1e-6)
    x3 = rng.standard_normal((5, 4, 64)).astype(np.float32)  # QK-norm: one row per (token, head), in place
    w3 = rng.standard_normal(64).astype(np.float32)
    a3 = cp.asarray(x3)
    gpu.rms_norm(a3, cp.asarray(w3), 1e-6, a3)
    assert_close(a3.get(), ref.rms_norm_ref(x3, w3, 1e-6), 1e-5, 1e-6)


def test_rope(gpu):
    cp, rng = gpu.cp, np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)
    pos = np.array([0, 1, 17, 300, 2047])
    for neox in (False, True):
        for n_rot, freq_scale, factors in ((64, 1.0, None), (32, 0.25, None),
                                           (64, 1.0, rng.uniform(1, 4, 32).astype(np.float32))):
            a = cp.asarray(x)
            gpu.rope(a, pos, n_rot, 10000.0, freq_scale, neox,
                     freq_factors=None if factors is None else cp.asarray(factors))
            # theta by repeated float32 products (as ggml's CPU cache) vs the float64 twin: <= 5e-4
            assert_close(a.get(), ref.rope_ref(x, pos, n_rot, 10000.0, freq_scale, neox, factors), 1e-4, 5e-4)
    big = np.array([5, 999, 40_000, 99_999, 77])  # far positions: the same float32 theta as the CPU backend
    a, want = cp.asarray(x), x.copy()
    gpu.rope(a, big, 64, 1e6, 1.0, True)
    CPUBackend().rope(want, big, 64, 1e6, 1.0, True)
    assert_close(a.get(), want, 1e-4, 1e-4)


ATTENTION_CASES = [  # n_tok, n_head, n_kv_head, hd_k, hd_v, dtype, window, n_slots, n_past
    (1, 8, 2, 64, 64, np.float16, 0, 64, 40),  # decode, GQA 4
    (9, 4, 4, 32, 32, np.float32, 0, 64, 11),  # prompt batch after a prefix, f32 KV
    (6, 4, 1, 256, 256, np.float16, 8, 14, 20),  # sliding window on a ring that has wrapped, head_dim 256
    (5, 6, 3, 64, 32, np.float16, 0, 32, 7),  # hd_k != hd_v
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"tok{c[0]}-h{c[1]}/{c[2]}-hd{c[3]}/{c[4]}-w{c[6]}")
def test_attention_and_kv_store(gpu, case):
    n_tok, n_head, n_kv, hd_k, hd_v, dtype, window, n_slots, n_past = case
    cp, rng, cpu = gpu.cp, np.random.default_rng(3), CPUBackend()
    kv = gpu.kv_layer(n_slots, n_kv, hd_k, hd_v, dtype, window)
    kv_cpu = cpu.kv_layer(n_slots, n_kv, hd_k, hd_v, dtype, window)
    steps = [np.array([p]) for p in range(n_past)] + [np.arange(n_past, n_past + n_tok)]
    for p in steps:  # the past one token at a time (decode), then the new tokens as one batch
        k = rng.standard_normal((len(p), n_kv, hd_k)).astype(np.float32)
        v = rng.standard_normal((len(p), n_kv, hd_v)).astype(np.float32)
        gpu.kv_store(kv, cp.asarray(k), cp.asarray(v), p)
        cpu.kv_store(kv_cpu, k, v, p)
    np.testing.assert_array_equal(kv.k.get(), kv_cpu.k)
    np.testing.assert_array_equal(kv.v.get(), kv_cpu.v)
    np.testing.assert_array_equal(kv.pos_device.get(), kv_cpu.pos.astype(np.int32))
    q = rng.standard_normal((n_tok, n_head, hd_k)).astype(np.float32)
    scale = 1.0 / math.sqrt(hd_k)
    out = cp.empty((n_tok, n_head * hd_v), dtype=cp.float32)
    gpu.attention(cp.asarray(q), kv, steps[-1], scale, out)
    assert_close(out.get(), ref.attention_ref(q, kv_cpu.k, kv_cpu.v, kv_cpu.pos, steps[-1], scale, window),
                 1e-4, 1e-5)


@pytest.mark.parametrize("kind", list(ref.KV_QUANT_TYPES))
def test_quantized_kv_cache_equals_the_cpu_backends(gpu, kind):
    """A q8_0 / q4_0 paged cache (kv_store_q8_0 / kv_store_q4_0, then attention over the blocks
    dequantized): after every step of ref.quantized_kv_steps the GPU's blocks equal the CPU backend's
    bytes and quantize_kv_ref's (the quantizers' corners), and attention equals the CPU's."""
    checks = list(ref.quantized_kv_steps(gpu, CPUBackend(), kind, np.random.default_rng(8)))
    assert len(checks) == 10
    for name, got, want, exact in checks:
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            assert_close(got, want, 1e-4, 1e-5)


# ============================================================================ element-wise, crossings
def test_elementwise_and_crossings(gpu):
    cp, rng = gpu.cp, np.random.default_rng(4)
    n = 10007  # not a multiple of the 256 threads of a block
    gate = (rng.standard_normal(n) * 4).astype(np.float32)
    up = rng.standard_normal(n).astype(np.float32)
    for op, want in ((gpu.silu_mul, ref.silu_mul_ref(gate, up)), (gpu.gelu_mul, ref.gelu_mul_ref(gate, up))):
        out = cp.empty(n, dtype=cp.float32)
        op(cp.asarray(gate), cp.asarray(up), out)
        assert_close(out.get(), want, 1e-5, 1e-6)
    x = rng.standard_normal((6, 333)).astype(np.float32)
    y = rng.standard_normal((6, 333)).astype(np.float32)
    bias = rng.standard_normal(333).astype(np.float32)
    a = cp.asarray(x)
    gpu.add(a, cp.asarray(y), a)
    np.testing.assert_array_equal(a.get(), x + y)
    a = cp.asarray(x)
    gpu.add(a, cp.asarray(bias), a)
    np.testing.assert_array_equal(a.get(), x + bias)
    x3 = rng.standard_normal((5, 4, 16)).astype(np.float32)  # q (n_tok, n_head, head_dim) + bias (n_head, head_dim)
    bias2 = rng.standard_normal((4, 16)).astype(np.float32)
    a = cp.asarray(x3)
    gpu.add(a, cp.asarray(bias2), a)
    np.testing.assert_array_equal(a.get(), x3 + bias2)
    a = cp.asarray(x)
    gpu.scale(a, 0.375)
    np.testing.assert_array_equal(a.get(), x * np.float32(0.375))
    np.testing.assert_array_equal(gpu.to_host(gpu.from_host(x)), x)
    np.testing.assert_array_equal(gpu.to_host(gpu.from_host(x[:, ::2])), x[:, ::2])  # a strided host view


# ============================================================================ the stand-in is as strict as CuPy
def test_standin_rejects_host_device_mixups(monkeypatch):
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE", "1")
    from edgellm.errors import OutOfMemoryError
    from edgellm.kernels.cuda.backend import CudaBackend
    from edgellm.kernels.cuda.emulator.executor import EmuError

    b = CudaBackend()
    cp = b.cp
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(cp.asarray(x))
    with pytest.raises(TypeError, match="host"):  # a host array given to a kernel
        b.scale(x, 2.0)
    with pytest.raises(TypeError, match="host"):  # host arithmetic on a device array
        cp.asarray(x) * x
    fresh = cp.empty(4, dtype=cp.float32)
    assert np.isnan(fresh.get()).all()  # uninitialised device memory is garbage, not zeros
    # a host-side argument of the wrong width (np.int32 for an int64 parameter) is caught at launch
    fn = b._function("elementwise", "scale_f32")
    with pytest.raises(EmuError, match="argument 2"):
        fn((1,), (256,), (cp.asarray(x), np.float32(2), np.int32(x.size)))
    # the emulated VRAM is a budget: an upload past it is edgellm's OutOfMemoryError, saying what to do
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE_VRAM", "1MiB")

    class Tensor:  # what backend.weight reads of a GGUF tensor
        ne, n_rows, n_cols, name, nbytes = (512, 1024), 1024, 512, "blk.0.ffn_up.weight", 2 << 20
        qtype = SimpleNamespace(ggml_type=2)
        data = np.zeros((1024, 2048), np.uint8)

    with pytest.raises(OutOfMemoryError, match="fewer --gpu-layers"):
        b.weight(Tensor())


def test_not_emulated_without_the_variable(monkeypatch):
    """Without EDGELLM_CUDA_EMULATE the stand-in is never picked up."""
    from edgellm.kernels import cuda

    monkeypatch.delenv("EDGELLM_CUDA_EMULATE", raising=False)
    assert not cuda.emulated()
    ok, reason = cuda.available()
    assert "emulated" not in reason
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE", "0")
    assert not cuda.emulated()
    monkeypatch.setenv("EDGELLM_CUDA_EMULATE", "1")
    assert cuda.emulated() and cuda.available()[0]
    assert cuda.require().__name__.endswith("cupy_standin")


def test_cpu_path_never_imports_the_emulator(smollm2_path):
    import subprocess
    import sys

    code = ("import sys, edgellm; from edgellm.memory import free_vram; free_vram(); "
            "from edgellm.kernels import cuda; cuda.available(); "
            f"m = edgellm.load({str(smollm2_path)!r}, n_ctx=32); m.logits(m.tokenize('Hi')); "
            "print(sorted(n for n in sys.modules if 'emulator' in n or n.startswith('cupy')))")
    env = {k: v for k, v in os.environ.items() if k != "EDGELLM_CUDA_EMULATE"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"
