"""CUDA sources, checked without a GPU.

1. Every .cu module, as the loader hands it to NVRTC, compiles with nvcc for sm_75, sm_80 and sm_90
   (-cubin, so ptxas runs too), with no warnings, and every kernel the backend launches is in it.
2. The block decoders the kernels use are plain C++ (__host__ __device__), so they are built into a
   small host program with the C++ compiler and checked against gguf's dequantizer for all 13 types:
   the dequantized weights and the per-block dot product the matvec kernel accumulates.
3. Importing the CUDA package never imports CuPy; without CuPy or a device the errors say what to do.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from edgellm.errors import GPUUnavailableError
from edgellm.kernels import cuda
from edgellm.kernels.cuda.backend import CPU_ONLY_TYPES, QUANT_KERNELS, required_kernels
from edgellm.quants import QUANT_TYPES
from test_cuda_reference import random_blocks

ARCHS = ("sm_75", "sm_80", "sm_90")
CUPY_ADDED_OPTIONS = ("-ftz=true",)  # what cupy.RawModule appends to our options


def find_nvcc() -> str:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in sorted(Path("/usr/local").glob("cuda*/bin/nvcc"), reverse=True):
        return str(candidate)
    pytest.fail("nvcc was not found on PATH nor in /usr/local/cuda*/bin: install the CUDA toolkit so CI can "
                "compile-check the CUDA kernels")


def find_host_compiler() -> list[str]:
    for cxx in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cxx and shutil.which(cxx):
            return [cxx, "-x", "c++"]
    return [find_nvcc(), "-x", "cu"]  # nvcc compiles host code too


@pytest.fixture(autouse=True)
def real_cuda_path(monkeypatch):
    """These tests are about CuPy and nvcc: never the CPU stand-in, even if the variable is exported."""
    monkeypatch.delenv("EDGELLM_CUDA_EMULATE", raising=False)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory) -> Path:
    """The sources exactly as NVRTC receives them (headers pasted in)."""
    d = tmp_path_factory.mktemp("cuda_sources")
    for name in cuda.module_names():
        (d / f"{name}.cu").write_text(cuda.module_source(name))
    return d


def test_sources_are_self_contained():
    assert set(cuda.module_names()) >= {"quant_float", "quant_legacy", "quant_k", "norm_rope", "attention",
                                       "elementwise"}
    for name in cuda.module_names():
        text = cuda.module_source(name)
        # NVRTC has no host headers and CuPy's wheels need not ship CUDA's: nothing may be included.
        assert not re.search(r"^\s*#\s*include", text, re.MULTILINE), name
        assert "INFINITY" not in text and "int64_t" not in text, name


@pytest.mark.parametrize("arch", ARCHS)
def test_every_module_compiles(arch, source_dir, tmp_path):
    files = sorted(str(p) for p in source_dir.glob("*.cu"))
    cmd = [find_nvcc(), f"-arch={arch}", "-cubin", *cuda.COMPILE_OPTIONS, *CUPY_ADDED_OPTIONS,
           "--output-directory", str(tmp_path), *files]
    result = subprocess.run(cmd, capture_output=True, text=True)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"nvcc failed for {arch}:\n{log}"
    assert "warning" not in log.lower(), f"nvcc warnings for {arch}:\n{log}"
    for module, names in required_kernels().items():
        cubin = (tmp_path / f"{module}.cubin").read_bytes()
        missing = [n for n in names if b"\0" + n.encode() + b"\0" not in cubin]
        assert not missing, f"{module}.cu lacks kernels the backend launches: {missing}"


def test_every_quant_type_has_kernels():
    assert set(QUANT_KERNELS) == set(QUANT_TYPES) - CPU_ONLY_TYPES


# ---- host build of the block decoders ---------------------------------------------------------

HARNESS = r"""
#include "quant_float.cu"
#include "quant_legacy.cu"
#include "quant_k.cu"
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// stdin: raw blocks (n_blocks * type_size bytes) then x (n_blocks * block_size float32);
// stdout: dequantized weights (float32, NaN where no chunk wrote) then one dot product per block.
template <class Block>
static int run(long n_blocks) {
    std::vector<u8> raw((size_t)n_blocks * Block::type_size);
    std::vector<float> x((size_t)n_blocks * Block::block_size);
    std::vector<float> w(x.size(), NAN), dots(n_blocks);
    if (fread(raw.data(), 1, raw.size(), stdin) != raw.size()) return 2;
    if (fread(x.data(), sizeof(float), x.size(), stdin) != x.size()) return 2;
    for (long b = 0; b < n_blocks; ++b) {
        StoreF32Sink store = {&w[(size_t)b * Block::block_size]};
        DotSink dot = {&x[(size_t)b * Block::block_size], 0.0f};
        for (int c = 0; c < Block::chunks; ++c) {
            Block::decode(&raw[(size_t)b * Block::type_size], c, store);
            Block::decode(&raw[(size_t)b * Block::type_size], c, dot);
        }
        dots[b] = dot.acc;
    }
    fwrite(w.data(), sizeof(float), w.size(), stdout);
    fwrite(dots.data(), sizeof(float), dots.size(), stdout);
    return 0;
}

#define TYPES(X) X(f32, BlockF32) X(f16, BlockF16) X(bf16, BlockBF16) X(q4_0, BlockQ4_0) X(q4_1, BlockQ4_1) \
    X(q5_0, BlockQ5_0) X(q5_1, BlockQ5_1) X(q8_0, BlockQ8_0) X(q2_k, BlockQ2_K) X(q3_k, BlockQ3_K)           \
    X(q4_k, BlockQ4_K) X(q5_k, BlockQ5_K) X(q6_k, BlockQ6_K)

int main(int argc, char** argv) {
    if (argc == 2 && !strcmp(argv[1], "layout")) {  // name block_size type_size chunks
#define PRINT(NAME, B) printf("%s %d %d %d\n", #NAME, B::block_size, B::type_size, B::chunks);
        TYPES(PRINT)
        return 0;
    }
    if (argc != 3) return 1;
    const long n_blocks = atol(argv[2]);
#define RUN(NAME, B) if (!strcmp(argv[1], #NAME)) return run<B>(n_blocks);
    TYPES(RUN)
    return 1;
}
"""

@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("decoders")
    src = d / "harness.cpp"
    src.write_text(HARNESS)
    exe = d / "harness"
    cmd = [*find_host_compiler(), "-std=c++17", "-O1", "-fno-strict-aliasing", f"-I{cuda.SOURCE_DIR}", str(src),
           "-o", str(exe)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, f"host build of the CUDA block decoders failed:\n{result.stdout}{result.stderr}"
    return exe


def test_decoder_layouts_match_the_registry(harness):
    out = subprocess.run([str(harness), "layout"], capture_output=True, text=True, check=True).stdout
    layouts = {name: tuple(map(int, rest)) for name, *rest in (line.split() for line in out.splitlines())}
    for ggml_type, k in QUANT_KERNELS.items():
        qt = QUANT_TYPES[ggml_type]
        assert layouts[k.suffix] == (qt.block_size, qt.type_size, k.chunks), qt.name


@pytest.mark.parametrize("ggml_type", list(QUANT_KERNELS), ids=lambda t: t.name)
def test_decoder_matches_gguf_dequantize(ggml_type, harness):
    qt = QUANT_TYPES[ggml_type]
    rng = np.random.default_rng(int(ggml_type) + 1)
    n_blocks = 64 if qt.block_size > 1 else 4096
    raw = random_blocks(ggml_type, n_blocks, rng)
    x = rng.standard_normal(n_blocks * qt.block_size).astype(np.float32)
    result = subprocess.run([str(harness), QUANT_KERNELS[ggml_type].suffix, str(n_blocks)],
                            input=raw.tobytes() + x.tobytes(), capture_output=True, check=True)
    got = np.frombuffer(result.stdout, dtype=np.float32)
    w, dots = got[: x.size], got[x.size:]

    ref = qt.dequantize_reference(raw.reshape(1, -1)).reshape(-1)
    assert not np.isnan(w).any(), "some weights were not produced by any chunk"
    assert np.abs(ref).max() > 0
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())

    # The dot product sees each weight exactly once (a chunk decoding a weight twice would double it).
    per_block = ref.astype(np.float64).reshape(n_blocks, qt.block_size) * x.reshape(n_blocks, qt.block_size)
    expected = per_block.sum(axis=1)
    tolerance = 1e-5 * np.abs(per_block).sum(axis=1) + 1e-30
    assert np.all(np.abs(dots - expected) <= tolerance)


# ---- import hygiene and error messages -------------------------------------------------------

def test_importing_the_cuda_package_does_not_import_cupy():
    code = ("import sys; import edgellm.kernels.cuda, edgellm.kernels.cuda.backend; "
            "sys.exit(1 if 'cupy' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_missing_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    ok, reason = cuda.available()
    assert ok is False
    assert "pip install 'edgellm[cuda]'" in reason and "cupy-cuda13x" in reason
    with pytest.raises(GPUUnavailableError, match=r"pip install 'edgellm\[cuda\]'"):
        cuda.require()


def test_missing_device_says_no_device(monkeypatch):
    def no_device():
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_device))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    ok, reason = cuda.available()
    assert ok is False and "no CUDA device found" in reason
    with pytest.raises(GPUUnavailableError, match="no CUDA device found"):
        cuda.require()

    fake.cuda.runtime.getDeviceCount = lambda: 0
    assert cuda.available() == (False, "no CUDA device found; check the NVIDIA driver with nvidia-smi")
