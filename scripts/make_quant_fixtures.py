"""Dev tool: record what llama.cpp's quantizer makes of tests/quant_cases.py's inputs, as sha256
hashes in tests/data/quantize_llamacpp.json (tests compare edgellm's output with them; llama.cpp is
never needed to run the tests).

    python scripts/make_quant_fixtures.py --lib DIR_WITH_LIBLLAMA_AND_LIBGGML_BASE
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> int:
    import quant_cases
    from quantize_vs_llamacpp import llama_quantize, load_llama

    from edgellm.quants import QUANT_TYPES
    from gguf import GGMLQuantizationType as T

    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "quantize_llamacpp.json")
    args = ap.parse_args()
    lib = load_llama(args.lib)
    base = ctypes.CDLL(str(args.lib / "libggml-base.so"))

    blocks = {}
    for tname in quant_cases.BLOCK_TYPES:
        fn = getattr(base, f"quantize_row_{tname.lower().replace('_k', '_K')}_ref")
        for case, x in quant_cases.block_inputs().items():
            out = np.zeros(x.size // QUANT_TYPES[T[tname]].block_size * QUANT_TYPES[T[tname]].type_size, np.uint8)
            fn(x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.size))
            blocks.setdefault(tname, {})[case] = hashlib.sha256(out.tobytes()).hexdigest()

    files = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in quant_cases.MODELS:
            src = quant_cases.write_model(name, tmp)
            files[name] = {"input_sha256": hashlib.sha256(src.read_bytes()).hexdigest()}
            for ft in quant_cases.FILE_TYPES:
                dst = Path(tmp) / f"{name}.{ft}.gguf"
                llama_quantize(lib, src, dst, ft, 2, False)
                files[name][ft] = hashlib.sha256(dst.read_bytes()).hexdigest()
                dst.unlink()
    args.out.write_text(json.dumps({"source": "llama.cpp (llama-cpp-python 0.3.36's vendor tree), "
                                    "llama_model_quantize without an importance matrix; quantize_row_*_ref",
                                    "blocks": blocks, "files": files}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
