"""Dev check (needs llama-cpp-python): `edgellm quantize` of a synthetic F16 file of each
architecture writes the bytes llama.cpp's llama_model_quantize writes, for a few file types.

    python scripts/checks/arch_quantize_vs_llamacpp.py [ARCH ...]
"""
from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

SHAPE = dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=384, seed=3)
ARCHS = {"llama": {}, "qwen2": {}, "qwen3": {}, "gemma3": {}, "smollm3": {}, "granite": {},
         "olmo2": {"tied_output": False}, "phi3": {"tied_output": False, "name": "synthetic-longrope"},
         "qwen3moe": {"hparams": {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 256}},
         "qwen2moe": {"tied_output": False, "hparams": {"expert_count": 8, "expert_feed_forward_length": 256,
                                                        "expert_shared_feed_forward_length": 512}}}
FTYPES = {"Q4_K_M": 15, "Q5_K_S": 16, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2}  # llama_ftype values


def main() -> int:
    import llama_cpp
    from gguf import GGMLQuantizationType as T

    import edgellm
    from edgellm.synthetic import write_synthetic_gguf

    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for arch, kw in ARCHS.items():
            if sys.argv[1:] and arch not in sys.argv[1:]:
                continue
            src = write_synthetic_gguf(d / f"{arch}-f16.gguf", arch=arch, ggml_type=T.F16, **SHAPE, **kw)
            for tname, ftype in FTYPES.items():
                ref, ours = d / f"{arch}-{tname}-ref.gguf", d / f"{arch}-{tname}.gguf"
                p = llama_cpp.llama_model_quantize_default_params()
                p.ftype, p.nthread = ftype, 2
                if llama_cpp.llama_model_quantize(str(src).encode(), str(ref).encode(), ctypes.byref(p)) != 0:
                    print(f"{arch} {tname}: llama.cpp failed")
                    bad += 1
                    continue
                edgellm.quantize(src, ours, tname)
                same = ref.read_bytes() == ours.read_bytes()
                bad += not same
                print(f"{arch} {tname}: {'identical' if same else 'DIFFERENT'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
