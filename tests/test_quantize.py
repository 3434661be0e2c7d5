"""edgellm.quantize against llama.cpp: quantizer bytes, per-tensor recipes, whole files; round trips
through the loader; bad input."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgellm
import quant_cases
from edgellm.errors import EdgeLLMError
from edgellm.gguf_file import GGUFFile
from edgellm.quality import kquant, recipe
from edgellm.quality.quantize import QuantizeError, encode
from edgellm.quants import QUANT_TYPES

FIXTURES = json.loads((Path(__file__).parent / "data" / "quantize_llamacpp.json").read_text())


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quant_inputs")
    return {name: quant_cases.write_model(name, folder) for name in quant_cases.MODELS}


# ============================================================================ quantizers
@pytest.mark.parametrize("tname", quant_cases.BLOCK_TYPES)
def test_quantizer_bytes_equal_ggml_reference(tname):
    """Every block of every input case gives ggml's quantize_row_*_ref bytes (recorded hashes)."""
    for case, x in quant_cases.block_inputs().items():
        got = encode(T[tname], x.reshape(-1, 256))
        assert np.array_equal(got, encode(T[tname], x.reshape(-1, 256), reference=True))
        assert got.shape == (x.shape[0], QUANT_TYPES[T[tname]].type_size * 256 // QUANT_TYPES[T[tname]].block_size)
        assert sha(got.tobytes()) == FIXTURES["blocks"][tname][case], f"{tname} on {case}"


@pytest.mark.parametrize("tname", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_numba_kernels_equal_numpy_reference(tname):
    rng = np.random.default_rng(7)
    x = np.concatenate([*quant_cases.block_inputs(16).values(),
                        (rng.standard_normal((32, 256)) * 10.0 ** rng.uniform(-6, 2, (32, 1))).astype(np.float32)])
    assert np.array_equal(encode(T[tname], x), encode(T[tname], x, reference=True))


@pytest.mark.parametrize("tname", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_legacy_numba_kernels_equal_gguf_quants(tname):
    """The legacy types' Numba kernels give gguf's quants.quantize bytes (their reference), on every
    input case, on scales from 1e-6 to 1e2, and on values that land on .5 after scaling (roundf ties)."""
    from gguf import quants

    rng = np.random.default_rng(5)
    ties = np.tile(np.arange(-128, 128, dtype=np.float32) / 2, (4, 1))  # Q8_0: amax 64 -> x / d = k / 2 * 127 / 64
    halves = np.tile(np.arange(-16, 16, dtype=np.float32) + 0.5, (4, 8))  # Q4_0 / Q5_0 codes near .5 steps
    cases = [*quant_cases.block_inputs().values(), ties, halves,
             (rng.standard_normal((32, 256)) * 10.0 ** rng.uniform(-6, 2, (32, 1))).astype(np.float32)]
    t = T[tname]
    for x in cases:
        got = encode(t, x)
        want = np.asarray(quants.quantize(x, t)).view(np.uint8).reshape(len(x), -1)
        assert np.array_equal(got, want)
        assert np.array_equal(got, encode(t, x, reference=True))


def test_metadata_arrays_written_as_gguf_writes_them(tmp_path):
    """quantize's writer packs NumPy and string arrays whole; the bytes are gguf's writer's."""
    from gguf import GGUFValueType as V
    from gguf import GGUFWriter

    from edgellm.gguf_file import StringArray
    from edgellm.quality.quantize import _Writer

    strings = ["", "a", "\u2581the", "日本語", "<0x0A>", "x" * 300]
    ints = np.arange(-3, 1000, dtype=np.int32)
    floats = np.linspace(-1, 1, 77, dtype=np.float32)
    bools = np.array([True, False, True])
    paths = []
    for cls, arrays in ((GGUFWriter, (strings, ints.tolist(), floats.tolist(), bools.tolist())),
                        (_Writer, (StringArray(strings), ints, floats, bools))):
        path = tmp_path / f"{cls.__name__}.gguf"
        w = cls(path, "llama")
        for key, value, sub in zip(("s", "i", "f", "b"), arrays, (V.STRING, V.INT32, V.FLOAT32, V.BOOL)):
            w.add_key_value(key, value, V.ARRAY, sub_type=sub)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        paths.append(path)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert len(paths[0].read_bytes()) > 4 * 1003 + 8 * len(strings)


# (RMS error / RMS weight) of a Gaussian tensor after a round trip: ggml's search sits well under
# these; the simple min/max encoders of edgellm.synthetic (no search) are measured for comparison.
ERROR_BOUNDS = {"Q8_0": 0.006, "Q6_K": 0.02, "Q5_K": 0.04, "Q4_K": 0.08, "Q3_K": 0.165, "Q2_K": 0.32,
                "Q5_0": 0.047, "Q4_0": 0.095}


@pytest.mark.parametrize("tname", sorted(ERROR_BOUNDS))
def test_round_trip_error(tname):
    from edgellm.synthetic import K_ENCODERS

    x = quant_cases.block_inputs(256)["gauss"]
    t = T[tname]
    back = QUANT_TYPES[t].dequantize_reference(encode(t, x)).reshape(x.shape)
    rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2))
    assert rel < ERROR_BOUNDS[tname]
    assert rel > ERROR_BOUNDS[tname] / 4  # the bound is tight enough to catch a coarser quantizer
    if t in K_ENCODERS:  # the error-minimizing search beats plain min/max rounding
        simple = QUANT_TYPES[t].dequantize_reference(K_ENCODERS[t](x)).reshape(x.shape)
        assert rel < np.sqrt(np.mean((simple - x) ** 2) / np.mean(x**2))


def test_nearest_int_is_ggml_rounding():
    v = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 1e6 + 0.5], dtype=np.float32)
    assert kquant.nearest_int(v).tolist() == [0, 2, 2, 0, -2, 2, 1000000]


# ============================================================================ recipes
def types_of(path) -> dict[str, str]:
    return {n: t.qtype.name for n, t in GGUFFile(path).tensors.items()}


def test_recipe_q4_k_m_by_layer(models, tmp_path):
    """llama, 4 layers: Q4_K_M gives attention V and FFN down Q6_K in the layers use_more_bits picks
    (2 and 3 of 4), the head Q6_K; FFN down's 288-wide rows fall back (Q4_K -> Q5_0, Q6_K -> Q8_0)."""
    out = tmp_path / "q4km.gguf"
    r = edgellm.quantize(models["llama_f32"], out, "Q4_K_M")
    t = types_of(out)
    assert [recipe.use_more_bits(i, 4) for i in range(4)] == [False, False, True, True]
    assert [t[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q6_K", "Q6_K"]
    assert [t[f"blk.{i}.ffn_down.weight"] for i in range(4)] == ["Q5_0", "Q5_0", "Q8_0", "Q8_0"]  # 288 wide
    assert t["blk.0.ffn_gate.weight"] == t["blk.0.attn_q.weight"] == t["blk.0.attn_output.weight"] == "Q4_K"
    assert t["output.weight"] == "Q6_K" and t["token_embd.weight"] == "Q4_K"
    assert t["blk.0.attn_norm.weight"] == "F32"
    assert len(r.fallbacks) == 4 and ("blk.2.ffn_down.weight", T.Q6_K, T.Q8_0) in r.fallbacks
    head = GGUFFile(out)
    assert head.metadata["general.file_type"] == 15 and head.metadata["general.quantization_version"] == 2


def test_recipe_q2_k_q3_k_m_and_pure(models, tmp_path):
    llama, gemma = models["llama_f32"], models["gemma3_f16"]
    t = types_of(edgellm.quantize(llama, tmp_path / "a.gguf", "Q2_K").path)
    assert t["blk.0.attn_v.weight"] == "Q3_K"  # n_head / n_head_kv = 2 < 4
    assert t["blk.0.attn_q.weight"] == "Q2_K" and t["blk.0.ffn_down.weight"] == "Q4_0"  # Q3_K, 288 wide
    t = types_of(edgellm.quantize(gemma, tmp_path / "b.gguf", "Q2_K").path)
    assert t["blk.0.attn_v.weight"] == "Q4_K"  # n_gqa 4
    assert t["blk.1.ffn_down.weight"] == "Q3_K" and t["blk.1.attn_output.weight"] == "Q3_K"
    assert t["token_embd.weight"] == "Q6_K"  # tied: the head's type
    t = types_of(edgellm.quantize(llama, tmp_path / "c.gguf", "Q3_K_M").path)
    assert [t[f"blk.{i}.attn_v.weight"] for i in range(4)] == ["Q5_K", "Q5_K", "Q4_K", "Q4_K"]
    t = types_of(edgellm.quantize(llama, tmp_path / "d.gguf", "Q4_K_M", pure=True,
                                  output_type="q8_0", token_embedding_type="F16").path)
    assert {t[f"blk.{i}.attn_v.weight"] for i in range(4)} == {"Q4_K"}
    assert t["output.weight"] == "Q8_0" and t["token_embd.weight"] == "F16"
    t = types_of(edgellm.quantize(llama, tmp_path / "e.gguf", "Q8_0", leave_output_tensor=True).path)
    assert t["output.weight"] == "F32" and t["blk.0.ffn_down.weight"] == "Q8_0"


# ============================================================================ whole files
@pytest.mark.parametrize("name", sorted(quant_cases.MODELS))
def test_files_equal_llama_quantize(models, tmp_path, name):
    """Every type: the output file is llama_model_quantize's, byte for byte (recorded hashes)."""
    want = FIXTURES["files"][name]
    assert sha(models[name].read_bytes()) == want["input_sha256"], "the synthetic input changed: " \
        "re-record the fixtures with scripts/fixtures/make_quant_fixtures.py"
    differ = []
    for ft in quant_cases.FILE_TYPES:
        out = tmp_path / f"{ft}.gguf"
        edgellm.quantize(models[name], out, ft)
        if sha(out.read_bytes()) != want[ft]:
            differ.append(ft)
        out.unlink()
    assert differ == []


@pytest.mark.parametrize("ft", ["Q8_0", "Q6_K", "Q4_K_M", "Q3_K_S", "Q2_K", "BF16"])
def test_quantized_files_load_and_run(models, tmp_path, ft):
    """Loader round trip: the quantized model's logits stay close to the F16 source's, closer for
    more bits (mean KL over 16 positions)."""
    src = models["gemma3_f16"]
    out = edgellm.quantize(src, tmp_path / f"{ft}.gguf", ft).path
    ids = list(range(3, 19))
    ref = edgellm.load(src, n_ctx=64).logits(ids).astype(np.float64)
    got = edgellm.load(out, n_ctx=64).logits(ids).astype(np.float64)
    assert np.isfinite(got).all()

    def logp(z):
        z = z - z.max(axis=1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    p = logp(ref)
    kl = float((np.exp(p) * (p - logp(got))).sum(axis=1).mean())
    bound = {"BF16": 1e-4, "Q8_0": 1e-3, "Q6_K": 5e-3, "Q4_K_M": 3e-2, "Q3_K_S": 0.1, "Q2_K": 0.3}[ft]
    assert kl < bound


# ============================================================================ bad input
def test_errors_leave_nothing_behind(models, tmp_path):
    src = models["llama_f32"]
    q = edgellm.quantize(src, tmp_path / "q.gguf", "Q4_0").path
    cases = [
        (lambda: edgellm.quantize(src, tmp_path / "x.gguf", "Q4_Z"), "unknown TYPE"),
        (lambda: edgellm.quantize(q, tmp_path / "x.gguf", "Q8_0"), "--allow-requantize"),
        (lambda: edgellm.quantize(src, tmp_path / "missing" / "x.gguf", "Q8_0"), "does not exist"),
        (lambda: edgellm.quantize(tmp_path / "nope.gguf", tmp_path / "x.gguf", "Q8_0"), "no such file"),
        (lambda: edgellm.quantize(src, tmp_path / "x.gguf", "Q8_0", output_type="Q9"), "--output-type"),
        (lambda: edgellm.quantize(src, tmp_path / "x.gguf", "Q8_0", token_embedding_type="iq2_xxs"),
         "does not quantize to IQ2_XXS"),
    ]
    for call, words in cases:
        with pytest.raises(EdgeLLMError, match=words.replace("-", r"\-")):
            call()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]
    # requantizing is allowed when asked for, and a same-type tensor is copied, not requantized
    r = edgellm.quantize(q, tmp_path / "x.gguf", "Q8_0", allow_requantize=True)
    assert {t.dst_type for t in r.tensors if t.src_type == "Q4_0"} == {"Q8_0"}


def test_file_without_weights_or_layer_count(tmp_path):
    from gguf import GGUFWriter

    def write(path, with_matrix, block_count):
        w = GGUFWriter(path, "llama")
        if block_count:
            w.add_block_count(1)
        w.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
        if with_matrix:
            w.add_tensor("blk.0.ffn_down.weight", np.ones((4, 256), np.float32))
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
        return path

    with pytest.raises(QuantizeError, match="no 2-D weight tensors"):
        edgellm.quantize(write(tmp_path / "a.gguf", False, True), tmp_path / "o.gguf", "Q8_0")
    with pytest.raises(QuantizeError, match="block_count is missing"):
        edgellm.quantize(write(tmp_path / "b.gguf", True, False), tmp_path / "o.gguf", "Q4_K_M")
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "o.gguf.part").exists()


def test_cli(models, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "edgellm.cli", *map(str, a)], capture_output=True,
                                    text=True)
    ok = run("quantize", models["gemma3_f16"], tmp_path / "o.gguf", "q6_k")
    assert ok.returncode == 0, ok.stderr
    assert "token_embd.weight" in ok.stderr and "Q6_K" in ok.stderr and "bits/weight" in ok.stderr
    assert types_of(tmp_path / "o.gguf")["blk.0.ffn_up.weight"] == "Q6_K"
    bad = run("quantize", tmp_path / "o.gguf", tmp_path / "p.gguf", "Q4_0")
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "--allow-requantize" in bad.stderr


def test_the_encoders_compiled_code_goes_to_the_user_cache_dir(tmp_path):
    """The quantizers' Numba cache lands under edgellm's cache dir like the runtime kernels' (it went to
    the installed package's __pycache__, which may not be writable)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["EDGELLM_CACHE"] = str(tmp_path)
    code = ("import numba, edgellm.quality.legacy_numba, edgellm.quality.kquant_numba; "
            "print(numba.config.CACHE_DIR)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().startswith(str(tmp_path / "numba")), out.stdout + out.stderr
