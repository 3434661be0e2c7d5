"""Dev tool: quantize GGUF files with edgellm and with llama.cpp's `llama_model_quantize` (no importance
matrix) and compare them: whole-file bytes, and per tensor its type and data. Never imported by the
package; llama.cpp is a development reference only.

    python scripts/vs_llamacpp/quantize_vs_llamacpp.py [--llama-bin DIR] IN.gguf [IN2.gguf ...] \
        --types Q8_0,Q6_K,Q4_K_M [--out DIR] [--allow-requantize] [--hashes tests/data/quant_hashes.json]

--hashes writes {input name: {type: sha256 of llama.cpp's output}} for inputs that are synthetic
(tests rebuild them and compare edgellm's output hash with these).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llamacpp  # noqa: E402  (scripts/llamacpp.py: finds llama.cpp's library)


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
    llamacpp.add_argument(ap)
    ap.add_argument("--types", default="F16,Q8_0,Q6_K,Q5_K_M,Q5_K_S,Q5_1,Q5_0,Q4_K_M,Q4_K_S,Q4_1,Q4_0,Q3_K_L,Q3_K_M,Q3_K_S,Q2_K")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--allow-requantize", action="store_true")
    ap.add_argument("--hashes", type=Path, default=None)
    args = ap.parse_args()

    import edgellm

    lib = llamacpp.load_libllama(args.llama_bin)
    out = args.out or Path(tempfile.mkdtemp(prefix="quantcmp-"))
    hashes = {}
    bad = 0
    for src in args.inputs:
        for t in args.types.split(","):
            ref, mine = out / f"{src.stem}.{t}.llama.gguf", out / f"{src.stem}.{t}.edgellm.gguf"
            t_ref = llamacpp.llama_quantize(lib, src, ref, t, args.threads, args.allow_requantize)
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
