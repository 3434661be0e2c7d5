"""Dev tool: quantize GGUF files with edgellm and with llama.cpp's `llama_model_quantize` (no importance
matrix) and compare them: whole-file bytes, and per tensor its type and data. Never imported by the
package; llama.cpp is a development reference only.

    python scripts/quantize_vs_llamacpp.py --lib DIR_WITH_LIBLLAMA IN.gguf [IN2.gguf ...] \
        --types Q8_0,Q6_K,Q4_K_M [--out DIR] [--allow-requantize] [--hashes tests/data/quant_hashes.json]

--hashes writes {input name: {type: sha256 of llama.cpp's output}} for inputs that are synthetic
(tests rebuild them and compare edgellm's output hash with these).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

from gguf import LlamaFileType


class QuantizeParams(ctypes.Structure):  # llama.h: llama_model_quantize_params (0.3.36's vendor tree)
    _fields_ = [
        ("nthread", ctypes.c_int32), ("ftype", ctypes.c_int), ("output_tensor_type", ctypes.c_int),
        ("token_embedding_type", ctypes.c_int), ("allow_requantize", ctypes.c_bool),
        ("quantize_output_tensor", ctypes.c_bool), ("only_copy", ctypes.c_bool), ("pure", ctypes.c_bool),
        ("keep_split", ctypes.c_bool), ("dry_run", ctypes.c_bool), ("imatrix", ctypes.c_void_p),
        ("kv_overrides", ctypes.c_void_p), ("tt_overrides", ctypes.c_void_p),
        ("prune_layers", ctypes.c_void_p), ("max_buf_size", ctypes.c_size_t),
    ]


def load_llama(lib_dir: Path):
    for dep in ("libggml-base.so", "libggml-cpu.so", "libggml.so"):
        if (lib_dir / dep).exists():
            ctypes.CDLL(str(lib_dir / dep), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(lib_dir / "libllama.so"))
    lib.llama_model_quantize_default_params.restype = QuantizeParams
    lib.llama_model_quantize.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(QuantizeParams)]
    lib.llama_model_quantize.restype = ctypes.c_uint32
    lib.llama_backend_init()
    return lib


def llama_quantize(lib, src: Path, dst: Path, ftype: str, threads: int, allow_requantize: bool) -> float:
    p = lib.llama_model_quantize_default_params()
    p.ftype = int(getattr(LlamaFileType, "ALL_F32" if ftype == "F32" else f"MOSTLY_{ftype}"))
    p.nthread = threads
    p.allow_requantize = allow_requantize
    t0 = time.perf_counter()
    rc = lib.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc}) for {src} -> {ftype}")
    return time.perf_counter() - t0


def compare(a: Path, b: Path) -> dict:
    from edgellm.gguf_file import GGUFFile

    fa, fb = GGUFFile(a), GGUFFile(b)
    types_differ, data_differ = [], []
    for name, ta in fa.tensors.items():
        tb = fb.tensors.get(name)
        if tb is None or ta.qtype.name != tb.qtype.name:
            types_differ.append((name, ta.qtype.name, tb.qtype.name if tb else None))
        elif bytes(ta.data) != bytes(tb.data):
            data_differ.append((name, ta.qtype.name))
    same_file = a.read_bytes() == b.read_bytes()
    return {"same_file": same_file, "types_differ": types_differ, "data_differ": data_differ,
            "n_tensors": len(fa.tensors)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("inputs", nargs="+", type=Path)
    ap.add_argument("--lib", type=Path, required=True, help="folder holding libllama.so")
    ap.add_argument("--types", default="F16,Q8_0,Q6_K,Q5_K_M,Q5_K_S,Q5_1,Q5_0,Q4_K_M,Q4_K_S,Q4_1,Q4_0,Q3_K_L,Q3_K_M,Q3_K_S,Q2_K")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--allow-requantize", action="store_true")
    ap.add_argument("--hashes", type=Path, default=None)
    args = ap.parse_args()

    import edgellm

    lib = load_llama(args.lib)
    out = args.out or Path(tempfile.mkdtemp(prefix="quantcmp-"))
    hashes = {}
    bad = 0
    for src in args.inputs:
        for t in args.types.split(","):
            ref, mine = out / f"{src.stem}.{t}.llama.gguf", out / f"{src.stem}.{t}.edgellm.gguf"
            t_ref = llama_quantize(lib, src, ref, t, args.threads, args.allow_requantize)
            t0 = time.perf_counter()
            edgellm.quantize(src, mine, t, allow_requantize=args.allow_requantize, threads=args.threads)
            t_mine = time.perf_counter() - t0
            c = compare(mine, ref)
            ok = not c["types_differ"] and not c["data_differ"]
            bad += not ok
            print(f"{src.name:40s} {t:7s} file {'identical' if c['same_file'] else 'differs'}  tensors "
                  f"{'identical' if ok else 'DIFFER'}  edgellm {t_mine:6.2f} s  llama.cpp {t_ref:6.2f} s"
                  + (f"\n   types: {c['types_differ'][:4]}\n   data: {c['data_differ'][:4]}" if not ok else ""),
                  flush=True)
            hashes.setdefault(src.name, {})[t] = hashlib.sha256(ref.read_bytes()).hexdigest()
            if not args.out:
                ref.unlink()
                mine.unlink()
    if args.hashes:
        args.hashes.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
