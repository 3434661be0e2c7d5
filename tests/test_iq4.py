"""The IQ types (IQ4_NL, IQ4_XS, the grid types IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, and IQ1_S,
IQ1_M) and the ternary TQ1_0, TQ2_0 against llama.cpp itself, from fixtures written by
scripts/fixtures/make_iq4_fixtures.py (llama.cpp is not needed here):
- ggml's own vec_dot on random rows: the one-token kernels and their NumPy twins, bit for bit;
- small llama-shaped files quantized by llama_model_quantize (IQ4_NL pure, IQ4_XS mixed with
  Q6_K / Q5_K, each grid and IQ1 type pure with an importance matrix, the TQ types pure): every
  logit of the prompt (a 24-token batch: repacked IQ4_NL gemm, tinyBLAS for the 340-row head, the
  tiled order of IQ4_XS, the grid and IQ1 types, vec_dot for TQ) and the greedy continuation (one
  token at a time: gemv, vec_dot) equal llama.cpp's, bit for bit."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import edgellm
from edgellm.gguf_file import GGUFFile
from edgellm.kernels import cpu
from edgellm.kernels.cpu import reference as ref

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "fixtures"))
import make_iq4_fixtures as fx  # noqa: E402  (the fixture writer: cases, shapes and seeds live there)


def sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


VEC_DOT = [(fname, t, n) for fname, cases in fx.VEC_DOT_FILES.items() for t, n in cases]


@pytest.mark.parametrize("fname, tname, n_cols", VEC_DOT)
def test_one_token_products_equal_ggml_vec_dot(fname, tname, n_cols):
    want = np.load(DATA / fname)[f"{tname}_{n_cols}"]
    raw, x = fx.vec_dot_inputs(tname, n_cols)
    assert raw.shape[0] % 8  # 9 rows: IQ4_NL is not repacked, its matvec is vec_dot
    out = np.empty(raw.shape[0], np.float32)
    cpu.bind(T[tname], raw, n_cols).matvec(x, out)
    np.testing.assert_array_equal(out, want)
    xq, xd, xs, _ = cpu.quantize(cpu.activation_format(T[tname]), x).parts
    if tname == "IQ4_NL":
        twin = ref.rowdot_iq4_nl(raw, xq, xd, "vec_dot")
    elif tname == "IQ4_XS":
        twin = ref.rowdot_iq4_xs(raw, xq, xd, False)
    elif tname.startswith("TQ"):
        twin = ref.rowdot_tq(tname, raw, xq, xd, xs)
    elif tname.startswith("IQ1"):
        twin = ref.rowdot_iq1(tname, raw, xq, xd, False)
    else:
        twin = ref.rowdot_igrid(tname, raw, xq, xd, False)
    np.testing.assert_array_equal(twin, want)


@pytest.mark.parametrize("tname", list(fx.FILES))
def test_synthetic_file_matches_llamacpp_bit_for_bit(tname, tmp_path):
    from edgellm.synthetic import write_synthetic_gguf

    meta = json.loads((DATA / f"oracle_synthetic_llama_{tname}.json").read_text())
    z = np.load(DATA / f"oracle_synthetic_llama_{tname}.npz")
    path = DATA / f"synthetic_llama_{tname}.gguf"
    assert sha256(path) == meta["sha256"]
    # the F32 file llama.cpp quantized is edgellm's writer's, rebuilt here from the same seed
    assert sha256(write_synthetic_gguf(tmp_path / "f32.gguf", ggml_type=T.F32, **fx.SHAPE)) == meta["source_sha256"]
    types = {t.qtype.name for t in GGUFFile(path).tensors.values()}
    assert tname in types and (types == {tname, "F32"} if meta["pure"] else {"Q6_K", "Q5_K"} <= types), types
    model = edgellm.load(path, n_ctx=64, n_batch=64)
    tokens = z["0_tokens"]
    logits = model.logits(tokens)
    ours = np.take_along_axis(logits, z["0_top_ids"].astype(np.int64), axis=1)
    np.testing.assert_array_equal(ours, z["0_top_logits"])  # every position's top 64, bit for bit
    np.testing.assert_array_equal(logits.argmax(1), z["0_top_ids"][:, 0])
    greedy = [c.token for c in model.generate(tokens.tolist(), max_tokens=len(z["0_greedy"]), temperature=0,
                                              ignore_eos=True, cache_prompt=False)]
    assert greedy == z["0_greedy"].tolist()


def test_layers_with_iq4_tensors_stay_off_the_gpu():
    """No CUDA kernels for IQ4 yet: an explicit --gpu-layers N is refused before anything is
    allocated (a message that says what to do); "auto" plans 0 GPU layers and says why."""
    from edgellm.config import ModelConfig
    from edgellm.errors import UnsupportedTensorTypeError
    from edgellm.placement import make_plan

    gf = GGUFFile(DATA / "synthetic_llama_IQ4_XS.gguf")
    cfg = ModelConfig.from_gguf(gf)
    with pytest.raises(UnsupportedTensorTypeError, match=r"IQ4_XS tensors.*CPU only.*--gpu-layers 0"):
        make_plan(gf, cfg, gpu_layers=1, n_ctx=64, n_batch=64, kv_type="f16", vram="8GiB")
    for tname in ("IQ4_NL", *fx.GRID_TYPES, *fx.TQ_TYPES, *fx.IQ1_TYPES):
        with pytest.raises(UnsupportedTensorTypeError, match=f"{tname} tensors.*--gpu-layers 0"):
            edgellm.load(DATA / f"synthetic_llama_{tname}.gguf", gpu_layers=-1, n_ctx=64)
    p = make_plan(gf, cfg, gpu_layers="auto", n_ctx=64, n_batch=64, kv_type="f16", vram="8GiB")
    assert p.n_gpu_layers == 0 and p.output_device == "cpu" and set(p.layers) == {"cpu"}
    assert any("IQ4_XS" in n and "CPU only" in n for n in p.notes), p.notes


def test_plan_command_keeps_iq4_files_on_the_cpu(capsys):
    from edgellm.cli import main

    path = str(DATA / "synthetic_llama_IQ4_NL.gguf")
    assert main(["plan", path, "--vram", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 blocks on the GPU" in out and "IQ4_NL tensors, which run on the CPU only" in out
    assert main(["plan", path, "--vram", "4GiB", "-ngl", "1"]) != 0
    assert "use --gpu-layers 0" in capsys.readouterr().err
