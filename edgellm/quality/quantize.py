"""`edgellm.quantize(src, dst, type)`: write a GGUF file with llama-quantize's types and recipes.

Data flow: read the source header (GGUFFile, mmap) -> plan each tensor's type (recipe.plan_types, in
llama.cpp's tensor order) -> refuse what cannot be done before anything is written -> write the
header (metadata copied, general.file_type set) -> per tensor, a slab of rows at a time: to float32,
encode, into the output tensor buffer -> write it. Memory stays about one output tensor plus one
float32 slab. The output goes to a temporary file renamed into place only when complete.
"""
from __future__ import annotations

import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian, GGUFValueType, GGUFWriter

from edgellm.errors import EdgeLLMError, InvalidArgumentError, ModelNotFoundError
from edgellm.quality import recipe
from edgellm.quality.kquant import QK_K
from edgellm.quants import QUANT_TYPES

SLAB_ELEMENTS = 1 << 20  # weights converted per step (4 MiB of float32)
GGML_QNT_VERSION = 2


class QuantizeError(EdgeLLMError):
    """The quantization cannot be done as asked (quantized input, missing tensors or metadata...)."""


@dataclass
class TensorResult:
    name: str
    shape: tuple[int, ...]  # GGUF order (ne)
    src_type: str
    dst_type: str
    src_bytes: int
    dst_bytes: int


@dataclass
class QuantizeResult:
    path: Path
    file_type: str
    tensors: list[TensorResult]
    fallbacks: list  # [(name, wanted type, used type)]
    n_params: int
    seconds: float

    @property
    def src_bytes(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def dst_bytes(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.dst_bytes / max(self.n_params, 1)


# ============================================================================ encoders
def to_float32(t: T, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """uint8 (n_rows, row_bytes) of type t -> float32 (n_rows, n_cols), as ggml's to_float does."""
    if t == T.F32:
        return raw.view(np.float32).reshape(-1, n_cols)
    if t == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(-1, n_cols)
    return QUANT_TYPES[t].dequantize_reference(np.ascontiguousarray(raw)).reshape(-1, n_cols)


def encode(t: T, x: np.ndarray, reference: bool = False) -> np.ndarray:
    """float32 (n_rows, n_cols) -> uint8 (n_rows, row_bytes) in type t, ggml's reference bytes.
    Block types run the Numba kernels, or with `reference` their NumPy twins (same bytes): K-quants
    edgellm.quality.kquant, legacy types gguf's quants.quantize."""
    from gguf import quants

    n_rows, n_cols = x.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if reference:
        from edgellm.quality.kquant import K_QUANTIZERS
    else:
        from edgellm.quality.kquant_numba import K_QUANTIZERS
        from edgellm.quality.legacy_numba import LEGACY_QUANTIZERS

        fn = LEGACY_QUANTIZERS.get(t.name)
        if fn is not None:
            return fn(x).reshape(n_rows, -1)
    fn = K_QUANTIZERS.get(t.name)
    if fn is not None:
        return fn(x.reshape(-1, QK_K)).reshape(n_rows, -1)
    if t == T.F32:
        return x.view(np.uint8)
    if t == T.F16:
        return x.astype(np.float16).view(np.uint8)
    return np.asarray(quants.quantize(x, t)).view(np.uint8).reshape(n_rows, -1)


def _convert(info, new: T, out: np.ndarray, pool) -> None:
    """Fill out (n_rows, dst row bytes) with tensor `info` converted to `new`, a slab at a time."""
    n_rows, n_cols = info.shape
    step = max(1, SLAB_ELEMENTS // n_cols)
    src = info.data

    def one(r0: int) -> None:
        r1 = min(n_rows, r0 + step)
        out[r0:r1] = encode(new, to_float32(info.qtype.ggml_type, src[r0:r1], n_cols))

    list(pool.map(one, range(0, n_rows, step)))


def _drop_pages(gf, info) -> None:
    """Hand the source tensor's pages back (clean file pages; llama.cpp unmaps each weight after
    use too), so resident memory stays about one tensor, not the whole input."""
    import mmap

    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = info.offset // mmap.PAGESIZE * mmap.PAGESIZE
    end = min(gf.file_size, (info.offset + info.nbytes + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE)
    if end > start:
        gf._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)


# ============================================================================ metadata
_NP_VALUE_TYPES = {
    np.dtype(np.uint8): GGUFValueType.UINT8, np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16, np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32, np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32, np.dtype(np.uint64): GGUFValueType.UINT64,
    np.dtype(np.int64): GGUFValueType.INT64, np.dtype(np.float64): GGUFValueType.FLOAT64,
    np.dtype(np.bool_): GGUFValueType.BOOL,
}


class _Writer(GGUFWriter):
    """gguf's writer, with metadata arrays kept as the reader returns them (NumPy arrays,
    StringArray) and packed whole: gguf packs arrays element by element in Python, slow for a
    262144-entry vocabulary. Same bytes (tests/test_quantize.py)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        from edgellm.gguf_file import StringArray

        if isinstance(val, str):  # the file's bytes back as they were, valid UTF-8 or not (keys, names)
            val = val.encode("utf-8", "surrogateescape")

        fast = (vtype == GGUFValueType.ARRAY and isinstance(val, (np.ndarray, StringArray)) and len(val) > 0
                and self.endianess == GGUFEndian.LITTLE)
        if not fast:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        if isinstance(val, StringArray):
            return head + struct.pack("<IQ", GGUFValueType.STRING, len(val)) + val.records()
        etype = sub_type if sub_type is not None else _NP_VALUE_TYPES[val.dtype.newbyteorder("=")]
        return head + struct.pack("<IQ", etype, len(val)) + val.astype(val.dtype.newbyteorder("<")).tobytes()


def _copy_metadata(w: GGUFWriter, gf, file_type: int) -> None:
    """Every key in the source's order, with its type; then general.quantization_version and
    general.file_type last (llama.cpp's gguf_set_val_* removes a key and appends it)."""
    skip = {"general.quantization_version", "general.file_type", "split.no", "split.count",
            "split.tensors.count"}
    for key, value in gf.metadata.items():
        if key in skip or key == "general.architecture":
            continue
        vtype = GGUFValueType(gf.metadata_types[key])
        if vtype != GGUFValueType.ARRAY:
            w.add_key_value(key, value, vtype)
        elif len(value) == 0:  # the gguf writer cannot write an empty array
            continue
        elif isinstance(value, np.ndarray):
            w.add_key_value(key, value, vtype, sub_type=_NP_VALUE_TYPES[value.dtype.newbyteorder("=")])
        elif isinstance(value, list):  # arrays of arrays: rare; gguf infers the inner types
            w.add_key_value(key, value, vtype)
        else:  # StringArray
            w.add_key_value(key, value, vtype, sub_type=GGUFValueType.STRING)
    if "general.alignment" in gf.metadata:
        w.add_custom_alignment(int(gf.metadata["general.alignment"]))
    w.add_key_value("general.quantization_version", GGML_QNT_VERSION, GGUFValueType.UINT32)
    w.add_key_value("general.file_type", int(file_type), GGUFValueType.UINT32)


# ============================================================================ driver
def plan(gf, file_type: str, options: recipe.Options) -> tuple[list, dict, list]:
    """(tensor names in llama.cpp's order, {name: new type}, fallbacks) for an open GGUFFile."""
    names = recipe.llama_order(gf.tensors)
    table = [(n, gf.tensors[n].ne, gf.tensors[n].qtype.ggml_type) for n in names]
    model = recipe.Model.from_metadata(gf.metadata)
    types, fallbacks = recipe.plan_types(table, file_type, model, options)
    return names, types, fallbacks


def _check(gf, names, types, file_type: str, allow_requantize: bool) -> None:
    default = recipe.FILE_TYPES[file_type][1]
    changed = [n for n in names if types[n] != gf.tensors[n].qtype.ggml_type]
    if not any(recipe.allows_quantization(n, gf.tensors[n].ne, False) for n in names):
        raise QuantizeError(f"{gf.path}: no 2-D weight tensors to quantize (is this a model file?)")
    needs_layers = default not in recipe.FLOAT_TYPES and any(recipe.category(n) == "ffn_down" for n in names)
    if needs_layers and recipe.Model.from_metadata(gf.metadata).n_layer <= 0:
        arch = gf.metadata.get("general.architecture", "?")
        raise QuantizeError(f"{gf.path}: metadata key {arch}.block_count is missing; the {file_type} recipe "
                            "needs the layer count")
    for n in changed:
        src = gf.tensors[n].qtype.ggml_type
        if src not in recipe.FLOAT_TYPES and not allow_requantize:
            raise QuantizeError(f"{gf.path}: tensor {n} is already quantized ({src.name}); requantizing loses "
                                "quality - start from an F16/BF16/F32 file, or pass --allow-requantize "
                                "(allow_requantize=True)")
        if types[n] not in QUANT_TYPES:
            raise QuantizeError(f"tensor type {types[n].name} for {n} is not supported by edgellm")


def quantize(src: str | os.PathLike, dst: str | os.PathLike, type: str = "Q4_K_M", *, pure: bool = False,
             allow_requantize: bool = False, leave_output_tensor: bool = False, output_type: str | None = None,
             token_embedding_type: str | None = None, threads: int | None = None,
             progress: Callable[[int, int, TensorResult], None] | None = None) -> QuantizeResult:
    """Quantize GGUF file `src` into `dst` as llama-quantize would (llama.cpp's type names, recipes and
    fallbacks, no importance matrix). Returns what was written; raises an EdgeLLMError on bad input and
    leaves no partial `dst` behind."""
    from edgellm.gguf_file import GGUFFile

    t0 = time.perf_counter()
    file_type = recipe.parse_type(type)
    options = recipe.Options(
        pure=pure, leave_output=leave_output_tensor,
        output_type=recipe.parse_tensor_type(output_type, "--output-type") if output_type else None,
        token_embedding_type=(recipe.parse_tensor_type(token_embedding_type, "--token-embedding-type")
                              if token_embedding_type else None),
    )
    for t in (options.output_type, options.token_embedding_type):
        if t is not None and t not in QUANT_TYPES:
            raise InvalidArgumentError(f"tensor type {t.name} is not supported by edgellm")
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise ModelNotFoundError(f"{src}: no such file")
    if not dst.parent.is_dir():
        raise InvalidArgumentError(f"{dst.parent}: output folder does not exist; create it first")
    if dst.resolve() == src.resolve():
        raise InvalidArgumentError(f"{dst}: the output must not be the input file")
    if threads is not None and threads < 1:
        raise InvalidArgumentError(f"threads={threads}: must be >= 1")

    gf = GGUFFile(src)
    names, types, fallbacks = plan(gf, file_type, options)
    _check(gf, names, types, file_type, allow_requantize)

    arch = str(gf.metadata.get("general.architecture", "llama"))
    tmp = dst.with_name(dst.name + ".part")
    results = []
    w = _Writer(tmp, arch)
    try:
        _copy_metadata(w, gf, recipe.FILE_TYPES[file_type][0])
        for n in names:
            info = gf.tensors[n]
            new = types[n]
            nbytes = info.n_rows * QUANT_TYPES[new].row_bytes(info.n_cols)
            w.add_tensor_info(n, tuple(reversed(info.ne)), np.dtype(np.float32), nbytes, raw_dtype=new)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        with ThreadPoolExecutor(max_workers=threads or min(4, os.cpu_count() or 1)) as pool:
            for i, n in enumerate(names):
                info = gf.tensors[n]
                new = types[n]
                if new == info.qtype.ggml_type:
                    out = np.asarray(info.data)
                else:
                    out = np.empty((info.n_rows, QUANT_TYPES[new].row_bytes(info.n_cols)), dtype=np.uint8)
                    _convert(info, new, out, pool)
                w.write_tensor_data(out)
                r = TensorResult(n, info.ne, info.qtype.name, new.name, info.nbytes, out.nbytes)
                del out
                _drop_pages(gf, info)
                results.append(r)
                if progress is not None:
                    progress(i + 1, len(names), r)
        w.close()
        os.replace(tmp, dst)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise
    finally:
        gf.close()
    n_params = sum(gf.tensors[n].n_elements for n in names)
    return QuantizeResult(dst, file_type, results, fallbacks, n_params, time.perf_counter() - t0)
