"""edgellm.kernels.cpu against gguf.quants.dequantize (bit-exact) and a float64 reference product."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf.quants import dequantize as gguf_dequantize

from edgellm.errors import InvalidArgumentError, UnsupportedTensorTypeError
from edgellm.kernels import cpu
from edgellm.quants import QUANT_TYPES
from quant_blocks import random_rows

ALL_TYPES = list(QUANT_TYPES)
DENSE = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
K_QUANTS = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K}


def widths(t):
    """Row widths to test: K-quants need multiples of 256, legacy / float types also take 576, 640."""
    return [1536, 2048] if t in K_QUANTS else [576, 640, 1536, 2048]


def reference(t, raw):
    """float64 (n_rows, n_cols) weights from the gguf reference dequantizer."""
    n_rows = raw.shape[0]
    return np.asarray(gguf_dequantize(np.asarray(raw), t), np.float64).reshape(n_rows, -1)


def tolerance(t, w64, x):
    """Per-output bound on |kernel - float64 reference| for out = W @ x (w64 (n_rows, n_cols)).

    Quantized types: matvec rounds x to int8 in blocks of 32 with scale amax/127, so each x_i moves
    by at most half a step, amax_b/254, and the product by at most sum_b amax_b/254 * sum_{i in b}|w_i|
    (integer dot products are exact). Float types use x as is. On top, float32 rounding of the
    scales and of the accumulation: well under 2e-5 relative to sum|w||x| for rows <= 4096 wide
    (~(n/32 + 30) roundings of 2^-24 each, summed in absolute value).
    """
    absw = np.abs(w64)
    x64 = np.abs(x.astype(np.float64))
    bound = 2e-5 * (absw @ x64) + 1e-30
    if t not in DENSE:
        amax = x64.reshape(-1, 32).max(axis=1)  # (n_blocks,)
        step = amax / 254.0 * (1 + 1e-5)
        bound += absw.reshape(w64.shape[0], -1, 32).sum(axis=2) @ step
    return bound


def check_matvec(t, raw, x):
    out = np.full(raw.shape[0], np.nan, np.float32)
    cpu.matvec(t, raw, x, out)
    w64 = reference(t, raw)
    err = np.abs(out - w64 @ x.astype(np.float64))
    bound = tolerance(t, w64, x)
    assert np.all(err <= bound), f"{t.name}: worst err/bound {np.max(err / bound):.3f}"
    return out


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(t):
    for n_rows, n_cols in [(1, widths(t)[0]), (7, widths(t)[-1]), (33, widths(t)[1])]:
        raw = random_rows(t, n_rows, n_cols, seed=n_rows)
        out = np.full((n_rows, n_cols), np.nan, np.float32)
        cpu.dequantize(t, raw, out)
        ref = np.asarray(gguf_dequantize(raw, t), np.float32).reshape(n_rows, n_cols)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), t.name


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matvec_matches_float64_reference(t):
    rng = np.random.default_rng(1)
    for n_rows in (1, 7, 33):
        for n_cols in widths(t):
            raw = random_rows(t, n_rows, n_cols, seed=n_rows + n_cols)
            x = rng.standard_normal(n_cols).astype(np.float32)
            x[::7] *= 20.0  # outliers make the 8-bit steps of some blocks coarse
            check_matvec(t, raw, x)


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matvec_is_deterministic_and_reads_read_only_weights(t):
    raw = random_rows(t, 257, 2048, seed=3)
    raw.flags.writeable = False
    x = np.random.default_rng(4).standard_normal(2048).astype(np.float32)
    first, again = np.empty(257, np.float32), np.empty(257, np.float32)
    cpu.matvec(t, raw, x, first)
    for _ in range(3):
        cpu.matvec(t, raw, x, again)
        assert np.array_equal(first.view(np.uint32), again.view(np.uint32))


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(t):
    rng = np.random.default_rng(5)
    n_cols = 1536
    raw = random_rows(t, 33, n_cols, seed=6)
    w64 = reference(t, raw)
    for n_tok in (1, 5, 64):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        out = np.full((n_tok, 33), np.nan, np.float32)
        cpu.matmul(t, raw, x, out)
        for i in range(n_tok):
            # n_tok > 1 dequantizes exactly and multiplies in float32: the float bound applies
            bound = tolerance(GGMLType.F32 if n_tok > 1 else t, w64, x[i])
            err = np.abs(out[i] - w64 @ x[i].astype(np.float64))
            assert np.all(err <= bound), f"{t.name} n_tok={n_tok} row {i}"


def test_matmul_spans_several_tiles():
    t = GGMLType.Q4_0
    raw = random_rows(t, 700, 2048, seed=7)  # 700 rows = 2 full tiles of 256 and a partial one
    x = np.random.default_rng(8).standard_normal((3, 2048)).astype(np.float32)
    out = np.empty((3, 700), np.float32)
    cpu.matmul(t, raw, x, out)
    w64 = reference(t, raw)
    for i in range(3):
        assert np.all(np.abs(out[i] - w64 @ x[i].astype(np.float64))
                      <= tolerance(GGMLType.F32, w64, x[i]))


# --- real tensors -------------------------------------------------------------------------
def _real_tensors(name):
    """One 2-D tensor per type in a real model file: {GGMLType: TensorInfo}."""
    from edgellm.fetch import model_path
    from edgellm.gguf_file import GGUFFile

    f = GGUFFile(model_path(name, quiet=True))
    picked = {}
    for info in f.tensors.values():
        if len(info.ne) == 2 and info.qtype.ggml_type not in picked:
            picked[info.qtype.ggml_type] = info
    return picked


@pytest.mark.real
@pytest.mark.parametrize("model, types", [
    ("smollm2-135m", {GGMLType.Q4_1, GGMLType.Q8_0}),
    ("gemma3-270m", {GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K}),
])
def test_real_tensors(model, types):
    tensors = _real_tensors(model)
    assert types <= set(tensors), f"{model}: expected tensor types {types}, found {set(tensors)}"
    rng = np.random.default_rng(9)
    for t, info in tensors.items():
        raw = info.data[:96]  # memmap rows, read-only, never copied
        assert isinstance(raw, np.ndarray) and not raw.flags.owndata
        out = np.empty((raw.shape[0], info.n_cols), np.float32)
        cpu.dequantize(t, raw, out)
        ref = np.asarray(gguf_dequantize(np.asarray(raw), t), np.float32).reshape(out.shape)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), f"{model} {info.name}"
        x = rng.standard_normal(info.n_cols).astype(np.float32)
        check_matvec(t, raw, x)


# --- contract details ------------------------------------------------------------------------
def test_supported_types_cover_the_quant_registry():
    assert set(cpu.supported_types()) == set(QUANT_TYPES)


def test_import_does_not_import_numba():
    code = "import sys, edgellm.kernels.cpu; print('numba' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_numba_cache_dir_follows_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu.numba_cache_dir() == tmp_path / "edgellm" / "numba"


def test_bad_arguments_raise_clear_errors():
    raw = random_rows(GGMLType.Q4_0, 4, 64)
    with pytest.raises(InvalidArgumentError, match="bytes"):
        cpu.matvec(GGMLType.Q4_0, raw, np.zeros(96, np.float32), np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="float32"):
        cpu.matvec(GGMLType.Q4_0, raw, np.zeros(64, np.float64), np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="C-contiguous uint8"):
        cpu.dequantize(GGMLType.Q4_0, raw[:, ::2], np.zeros((4, 32), np.float32))
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS"):
        cpu.matvec(GGMLType.IQ2_XXS, raw, np.zeros(64, np.float32), np.zeros(4, np.float32))
