"""Inputs shared by tests/test_quantize.py and scripts/fixtures/make_quant_fixtures.py (which records what
llama.cpp makes of them in tests/data/quantize_llamacpp.json).

Two small synthetic models with awkward shapes on purpose: rows of 128 and 288 weights (not whole
256-weight super-blocks, so K-quant recipes fall back), grouped-query attention (n_gqa 4, which
changes Q2_K's attention-V type), an untied output head (llama) and a tied one (gemma3).
And block inputs for the quantizers alone: Gaussian, heavy-tailed, all-positive, on the f16 grid,
with zero blocks and zero sub-blocks.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

MODELS = {
    "llama_f32": dict(arch="llama", n_layer=4, n_embd=256, n_head=2, n_head_kv=1, head_dim=128, n_ff=288,
                      n_vocab=300, ggml_type=T.F32, tied_output=False, seed=11),
    "gemma3_f16": dict(arch="gemma3", n_layer=2, n_embd=256, n_head=4, n_head_kv=1, head_dim=64, n_ff=512,
                       n_vocab=280, ggml_type=T.F16, tied_output=True, seed=12),
}
FILE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S",
              "Q4_1", "Q4_0", "Q3_K_L", "Q3_K_M", "Q3_K_S", "Q2_K")
BLOCK_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def write_model(name: str, folder) -> Path:
    from edgellm.synthetic import write_synthetic_gguf

    return write_synthetic_gguf(Path(folder) / f"{name}.gguf", **MODELS[name])


def block_inputs(n_blocks: int = 64) -> dict[str, np.ndarray]:
    """name -> float32 (n_blocks, 256)."""
    rng = np.random.default_rng(1234)
    z = rng.standard_normal((n_blocks, 256)).astype(np.float32)
    z[: n_blocks // 8] = 0  # whole zero blocks
    z[n_blocks // 8 : n_blocks // 4, :40] = 0  # zero sub-blocks
    z[n_blocks // 4 : n_blocks // 4 + 2] = 1.5  # constant blocks
    return {
        "gauss": (0.02 * rng.standard_normal((n_blocks, 256))).astype(np.float32),
        "heavy": (0.05 * rng.standard_t(3, (n_blocks, 256))).astype(np.float32),
        "positive": np.abs(rng.standard_normal((n_blocks, 256))).astype(np.float32),
        "f16grid": (0.03 * rng.standard_normal((n_blocks, 256))).astype(np.float16).astype(np.float32),
        "zeros": z,
    }
