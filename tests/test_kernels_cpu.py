"""edgellm.kernels.cpu against gguf.quants.dequantize (bit-exact), NumPy reimplementations of
ggml's activation conversions (bit-exact), and ggml's products evaluated exactly in float64."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from gguf.quants import dequantize as gguf_dequantize

from edgellm.errors import InvalidArgumentError, UnsupportedTensorTypeError
from edgellm.kernels import cpu
from edgellm.quants import QUANT_TYPES
from quant_blocks import F16_FIELDS, bf16_round, f16_round, random_rows, ref_q8_32, ref_q8_k

ALL_TYPES = list(QUANT_TYPES)
DENSE = {GGMLType.F32, GGMLType.F16, GGMLType.BF16}
K_QUANTS = {t for t, q in QUANT_TYPES.items() if q.block_size == 256}  # K-quants and IQ types of 256-blocks
WITH_Q8_1 = {GGMLType.Q4_1, GGMLType.Q5_1}  # x as Q8_1: the min term uses its fp16 s


def widths(t):
    """Row widths to test: 256-block types need multiples of 256, legacy / float types also take 576, 640."""
    return [1536, 2048] if t in K_QUANTS else [576, 640, 1536, 2048]


def reference(t, raw):
    """float64 (n_rows, n_cols) weights from the gguf reference dequantizer."""
    n_rows = raw.shape[0]
    return np.asarray(gguf_dequantize(np.asarray(raw), t), np.float64).reshape(n_rows, -1)


def split_weights(t, raw):
    """(scale part, min part) of the weights, float64 (n_rows, n_cols), both exact: the gguf
    dequantizer on copies with the min (dmin / m) field, resp. the scale (d) field, zeroed."""
    fields = F16_FIELDS.get(t, ())
    if len(fields) < 2:
        w = reference(t, raw)
        return w, np.zeros_like(w)
    size = QUANT_TYPES[t].type_size
    parts = []
    for zeroed in (fields[1], fields[0]):
        blocks = np.array(raw).reshape(raw.shape[0], -1, size)
        blocks[..., zeroed:zeroed + 2] = 0
        parts.append(reference(t, blocks.reshape(raw.shape)))
    return parts[0], parts[1]


def activation(t, x):
    """x as ggml's CPU backend hands it to the product with weights of type t, float64 (exact),
    and for Q8_1 the fp16 s of each block (else None)."""
    fmt = cpu.activation_format(t)
    if fmt == "q8_32":
        q, d, _, s = ref_q8_32(x)
        return q.astype(np.float64) * np.repeat(d.astype(np.float64), 32), s.astype(np.float64)
    if fmt == "q8_k":
        q, d, _ = ref_q8_k(x)
        return q.astype(np.float64) * np.repeat(d.astype(np.float64), 256), None
    rounded = {"f16": f16_round, "bf16": bf16_round, "f32": np.asarray}[fmt](x)
    return rounded.astype(np.float64), None


def ggml_product(t, w_scale, w_min, x, n_terms):
    """(ggml's W @ x evaluated exactly, bound on float32 rounding): integer dot products and
    fp16 scales are exact in float64; the kernel may differ by its float32 products and sums,
    (n_terms + 16) roundings of 2^-24 relative to the sum of the terms' magnitudes."""
    xv, s = activation(t, x)
    if t in WITH_Q8_1:  # sum_b d_w * d_x * sum(q * xq) + m_w * s_x
        m = w_min[:, ::32]
        exact = w_scale @ xv + m @ s
        mag = np.abs(w_scale) @ np.abs(xv) + np.abs(m) @ np.abs(s)
    else:
        exact = w_scale @ xv + w_min @ xv
        mag = np.abs(w_scale) @ np.abs(xv) + np.abs(w_min) @ np.abs(xv)
    return exact, (n_terms + 16) * 2.0**-24 * mag + 1e-30


def matvec_terms(t, n_cols):
    """Float additions in the kernel's chain per row: 2 per x block, or one per column."""
    return n_cols if t in DENSE else 2 * n_cols // (256 if t in K_QUANTS else 32)


def check_matvec(t, raw, x):
    out = np.full(raw.shape[0], np.nan, np.float32)
    cpu.matvec(t, raw, x, out)
    w_scale, w_min = split_weights(t, raw)
    exact, bound = ggml_product(t, w_scale, w_min, x, matvec_terms(t, x.size))
    err = np.abs(out - exact)
    assert np.all(err <= bound), f"{t.name}: worst err/bound {np.max(err / bound):.3f}"
    return out


def test_activation_quantizers_match_ggml_bit_exactly():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-6, 3, 4096)).astype(np.float32)
    x[:256] = 0.0  # a zero block of both formats
    x[256:288] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)  # ties: amax 15.5
    x[288:320] = np.float32(127.0) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[288:320][::3] += np.float32(0.5)  # amax 127: scale 1, exact halves round to even
    x[512:544] *= np.float32(1e-9)  # fp16 scale underflows to subnormal / zero
    x[1024:1280] = -np.abs(x[1024:1280])  # q8_k max negative
    for fmt, ref in (("q8_32", ref_q8_32), ("q8_k", ref_q8_k)):
        got = cpu.quantize(fmt, x).parts
        for name, a, b in zip(("q", "d", "sums", "s"), got, ref(x)):
            assert np.array_equal(a.view(np.uint8), np.asarray(b, a.dtype).view(np.uint8)), (fmt, name)
    wide = np.concatenate([x, np.float32([65504, 65519.99, 65520, 1e9, -7e-8, 3e-8, 2.98e-8,
                                          np.inf, -np.inf, 1e-45])])
    for fmt, ref in (("f16", f16_round), ("bf16", bf16_round)):
        got = cpu.quantize(fmt, wide).parts[0]
        assert np.array_equal(got.view(np.uint32), ref(wide).view(np.uint32)), fmt
    rows = x.reshape(4, 1024)
    for fmt in ("q8_32", "q8_k", "f16", "bf16"):  # what matmul multiplies: the same values
        back = cpu.requantize(fmt, rows)
        for i in range(4):
            xv, _ = activation({"q8_32": GGMLType.Q8_0, "q8_k": GGMLType.Q4_K,
                                "f16": GGMLType.F16, "bf16": GGMLType.BF16}[fmt], rows[i])
            assert np.array_equal(back[i], xv.astype(np.float32)), fmt


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_bit_exact(t):
    for n_rows, n_cols in [(1, widths(t)[0]), (7, widths(t)[-1]), (33, widths(t)[1])]:
        raw = random_rows(t, n_rows, n_cols, seed=n_rows)
        out = np.full((n_rows, n_cols), np.nan, np.float32)
        cpu.dequantize(t, raw, out)
        ref = np.asarray(gguf_dequantize(raw, t), np.float32).reshape(n_rows, n_cols)
        assert np.array_equal(out.view(np.uint32), ref.view(np.uint32)), t.name


@pytest.mark.parametrize("t", ALL_TYPES, ids=lambda t: t.name)
def test_matvec_matches_ggml_product(t):
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
def test_matmul_matches_ggml_product(t):
    rng = np.random.default_rng(5)
    n_cols = 1536
    raw = random_rows(t, 33, n_cols, seed=6)
    w_scale, w_min = split_weights(t, raw)
    for n_tok in (1, 5, 64):
        x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
        out = np.full((n_tok, 33), np.nan, np.float32)
        cpu.matmul(t, raw, x, out)
        for i in range(n_tok):
            # n_tok > 1: x converted as for matvec, back to float32, one BLAS sum per output
            n_terms = matvec_terms(t, n_cols) if n_tok == 1 else n_cols
            exact, bound = ggml_product(t, w_scale, w_min, x[i], n_terms)
            err = np.abs(out[i] - exact)
            assert np.all(err <= bound), f"{t.name} n_tok={n_tok} row {i}: {np.max(err / bound):.2f}"


@pytest.mark.parametrize("t", [GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q5_K, GGMLType.Q6_K], ids=lambda t: t.name)
def test_small_batches_are_the_one_token_products_bit_for_bit(t):
    """2..7 tokens (under the tiled kernel's 8): each token's outputs are its matvec's bits (the
    one-token order), from one pass over the rows."""
    rng = np.random.default_rng(11)
    raw = random_rows(t, 41, 1536, seed=12)
    for n_tok in range(2, 8):
        x = rng.standard_normal((n_tok, 1536)).astype(np.float32)
        out = np.full((n_tok, 41), np.nan, np.float32)
        cpu.matmul(t, raw, x, out)
        for i in range(n_tok):
            one = np.full(41, np.nan, np.float32)
            cpu.matvec(t, raw, x[i], one)
            assert np.array_equal(out[i].view(np.uint32), one.view(np.uint32)), (t.name, n_tok, i)


def test_matmul_spans_several_tiles(monkeypatch):
    monkeypatch.setattr(cpu, "_TILE_WEIGHTS", 256 * 2048)
    t = GGMLType.Q4_0
    raw = random_rows(t, 700, 2048, seed=7)  # 700 rows = 2 full tiles of 256 and a partial one
    x = np.random.default_rng(8).standard_normal((3, 2048)).astype(np.float32)
    out = np.empty((3, 700), np.float32)
    cpu.matmul(t, raw, x, out)
    w_scale, w_min = split_weights(t, raw)
    for i in range(3):
        exact, bound = ggml_product(t, w_scale, w_min, x[i], 2048)
        assert np.all(np.abs(out[i] - exact) <= bound)


def test_bound_matrices_shared_activations_and_one_shot_calls_agree():
    rng = np.random.default_rng(12)
    x = rng.standard_normal(1536).astype(np.float32)
    types = [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K, GGMLType.F16, GGMLType.F32]
    raws = [random_rows(t, 40 + k, 1536, seed=k) for k, t in enumerate(types)]
    mats = [cpu.bind(t, raw) for t, raw in zip(types, raws)]
    assert [m.act_format for m in mats] == ["q8_32", "q8_32", "q8_k", "q8_k", "f16", "f32"]
    outs = [np.empty(m.n_rows, np.float32) for m in mats]
    cpu.matvec_many(mats, x, outs)
    for t, raw, m, many in zip(types, raws, mats, outs):
        one_shot, bound, shared = (np.empty(m.n_rows, np.float32) for _ in range(3))
        cpu.matvec(t, raw, x, one_shot)
        m.matvec(x, bound)
        m.matvec_act(cpu.quantize(m.act_format, x), shared)
        for got in (bound, shared, many):
            assert np.array_equal(got.view(np.uint32), one_shot.view(np.uint32)), t.name
    with pytest.raises(InvalidArgumentError, match="q8_k"):
        mats[2].matvec_act(cpu.quantize("q8_32", x), outs[2])


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
        bound = cpu.bind(t, raw)  # the per-weight form the backend keeps
        out = np.empty(raw.shape[0], np.float32)
        bound.matvec(x, out)
        assert bound.n_cols == info.n_cols and np.all(np.isfinite(out))


# --- contract details ------------------------------------------------------------------------
def test_supported_types_cover_the_quant_registry():
    assert set(cpu.supported_types()) == set(QUANT_TYPES)


def test_each_type_record_matches_its_kernels():
    """kernels/cpu/tensor_types.py is the one record per type: its family holds the type's kernels,
    its fused flag matches the fused step's row kernels, its activation format the row kernel's."""
    from importlib import import_module

    from edgellm.kernels.cpu import fused
    from edgellm.kernels.cpu.tensor_types import ACT_BLOCK, FUSED_TYPES, TYPES

    for t, r in TYPES.items():
        assert r.act in ACT_BLOCK and QUANT_TYPES[t].block_size % ACT_BLOCK[r.act] == 0, t.name
        if r.family is not None:
            family = import_module(f"edgellm.kernels.cpu.{r.family}")
            assert t in family.KERNELS, t.name
    real = {int(t) for t in fused.ROW_ORDER} & {int(t) for t in TYPES}
    assert FUSED_TYPES == real
    assert {int(t) for t in fused.K_TYPES} & real == {int(t) for t in FUSED_TYPES if TYPES[GGMLType(t)].act == "q8_k"}


def test_import_does_not_import_numba():
    code = "import sys, edgellm.kernels.cpu; print('numba' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_numba_cache_dir_follows_the_user_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("EDGELLM_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu.numba_cache_dir().parent == tmp_path / "edgellm" / "numba"
    assert len(cpu.numba_cache_dir().name) == 16  # one folder per version of the kernel sources


def test_compiled_kernels_are_filed_by_their_folder_inside_the_package(tmp_path):
    """The disk cache names a kernel's folder by where its source sits inside edgellm, not by the
    checkout's absolute path (Numba's default), so another clone or venv of the same sources loads
    what this one compiled; functions of other packages keep Numba's own locator."""
    code = (
        "import numpy as np; from edgellm.kernels.cpu import legacy; from edgellm.kernels.cpu.jit import _inside_package\n"
        "raw = np.zeros((1, 18), np.uint8); out = np.ones((1, 32), np.float32)\n"
        "legacy.dequantize_q4_0(raw, out, 16); assert (out == 0).all()\n"
        "assert _inside_package(np.__file__) is None\n"
        "print(type(legacy.dequantize_q4_0._cache._impl.locator).__name__)"
    )
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "PackageCacheLocator"
    filed = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("legacy.dequantize_q4_0-*"))
    assert filed and all(f.startswith("kernels/cpu/legacy.dequantize_q4_0-") for f in filed), filed


def test_bad_arguments_raise_clear_errors():
    raw = random_rows(GGMLType.Q4_0, 4, 64)
    with pytest.raises(InvalidArgumentError, match="bytes"):
        cpu.matvec(GGMLType.Q4_0, raw, np.zeros(96, np.float32), np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="float32"):
        cpu.matvec(GGMLType.Q4_0, raw, np.zeros(64, np.float64), np.zeros(4, np.float32))
    with pytest.raises(InvalidArgumentError, match="C-contiguous uint8"):
        cpu.dequantize(GGMLType.Q4_0, raw[:, ::2], np.zeros((4, 32), np.float32))
    with pytest.raises(UnsupportedTensorTypeError, match="MXFP4"):
        cpu.matvec(GGMLType.MXFP4, raw, np.zeros(64, np.float32), np.zeros(4, np.float32))


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("rows", [(2048, 512, 512), (4096, 1024, 1024), (896, 128, 128), (16, 16, 16)])
def test_fused_qkv_runs_cover_every_chunk_once_and_split_the_bytes(n_threads, rows):
    """decode_layers gives each thread one run of the q, k, v chunks: the runs cut at byte shares
    (a Q6_K v row is 1.46 times a Q4_K k row) must tile the chunks, no chunk twice or left out,
    each run within a chunk's bytes of its share."""
    from edgellm.kernels.cpu import fused

    share, cut = fused._share.py_func, fused._qkv_cut.py_func
    cq, ck, cv = (-(-n // fused.CHUNK) for n in rows)
    rq, rk, rv = 2304, 1152, 1680  # bytes a row: Q4_K wq of 4096 columns, Q4_K wk / Q6_K wv of 2048
    n_bytes = cq * rq + ck * rk + cv * rv
    cuts = [cut(share(th, n_threads, n_bytes), cq, rq, ck, rk, cv, rv) for th in range(n_threads + 1)]
    assert cuts[0] == 0 and cuts[-1] == cq + ck + cv
    assert cuts == sorted(cuts)
    at = np.cumsum([0] + [rq] * cq + [rk] * ck + [rv] * cv)  # byte offset of each chunk
    for th in range(n_threads):
        assert abs(int(at[cuts[th + 1]] - at[cuts[th]]) - n_bytes / n_threads) <= 2 * max(rq, rk, rv)
    runs = [share(th, n_threads, 100) for th in range(n_threads + 1)]
    assert runs[0] == 0 and runs[-1] == 100 and all(b - a in (100 // n_threads, -(-100 // n_threads))
                                                    for a, b in zip(runs, runs[1:]))
