"""Does the emulated-GPU test suite catch kernel bugs? Plants one realistic bug at a time in a copy of
kernels/cuda/*.cu(h) and runs tests/test_cuda_emulated.py on the copy (EDGELLM_TEST_CUDA_SOURCES),
each in its own process (a planted out-of-bounds access ends the process with SIGSEGV).

    python scripts/checks/cuda_mutations.py            # prints CAUGHT / MISSED per bug; exit 1 if any missed
    python scripts/checks/cuda_mutations.py dp4a q8    # only the bugs whose label contains one of these words
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "kernels" / "cuda"

# (what the bug is, file, text, replacement, pytest -k filter)
MUTATIONS = [
    ("Q4_K decoder reads the wrong byte run (indexing)", "quant_k.cu",
     "const u8* qs = blk + 16 + 32 * k + o;", "const u8* qs = blk + 16 + 32 * k + o + (c & 1);", "Q4_K"),
    ("Q5_0 decoder drops the 5th bit of the high nibble (bit decoding)", "quant_legacy.cu",
     "const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);\n            sink.put(j, d * (float)(lo - 16));",
     "const int hi = (qs[j] >> 4);\n            sink.put(j, d * (float)(lo - 16));", "Q5_0"),
    ("warp_sum skips the first butterfly step (reduction)", "common.cuh",
     "for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync",
     "for (int offset = WARP_SIZE / 4; offset > 0; offset >>= 1) v += __shfl_xor_sync", "Q8_0"),
    ("rms_norm: first __syncthreads removed (race on shared memory)", "norm_rope.cu",
     "    if (lane == 0) warp_sums[warp] = sum;\n    __syncthreads();", "    if (lane == 0) warp_sums[warp] = sum;",
     "rms_norm"),
    ("rms_norm: second __syncthreads removed (race on shared memory)", "norm_rope.cu",
     "        warp_sums[0] = total;\n    }\n    __syncthreads();", "        warp_sums[0] = total;\n    }", "rms_norm"),
    ("attention: warps merge without __syncthreads (race)", "attention.cu",
     "        if (d < head_dim_v) acc_part[warp][d] = acc[i];\n    }\n    __syncthreads();",
     "        if (d < head_dim_v) acc_part[warp][d] = acc[i];\n    }", "attention"),
    ("matvec: lanes exit early, before the warp's shuffles (undefined behaviour on a GPU)", "quant_kernels.cuh",
     "    if (row >= n_rows) return;",
     "    if (row >= n_rows || (int)threadIdx.x >= (n_cols / Block::block_size) * Block::chunks / 2) return;", "Q4_K"),
    ("silu_mul: off-by-one bound (out-of-bounds access)", "elementwise.cu",
     "    if (i >= n) return;\n    const float g = gate[i];", "    if (i > n) return;\n    const float g = gate[i];",
     "elementwise"),
    ("attention: GQA maps head h to kv head h / n_kv_head (indexing)", "attention.cu",
     "const int kv_head = h / (n_head / n_kv_head);", "const int kv_head = h / n_kv_head;", "attention"),
    ("attention: sliding window keeps one key too many (mask off by one)", "attention.cu",
     "p - key_pos >= window", "p - key_pos > window", "attention"),
    ("rope: neox pairs (i, i + n_rot / 2 - 1) instead of (i, i + n_rot / 2) (layout)", "norm_rope.cu",
     "const int b = neox ? i + n_rot / 2 : 2 * i + 1;", "const int b = neox ? i + n_rot / 2 - 1 : 2 * i + 1;", "rope"),
    ("q8_K activations: a tie of magnitudes goes to the later value (the scale's sign)", "quant_act.cu",
     "(o_amax == amax && o_at < at)", "(o_amax == amax && o_at > at)", "quantizer"),
    ("q8_32 activations round half away from zero (roundf for round-half-even)", "quant_act.cu",
     "const int q = __float2int_rn(v * inv);", "const int q = (int)roundf(v * inv);", "quantizer"),
    ("Q4_1 q8 product adds m_w * s_x in every chunk, not once per block", "quant_legacy.cu",
     "return c == 0 ? r + f16_to_f32(load_u16(blk + 2)) * *a.m : r;",
     "return r + f16_to_f32(load_u16(blk + 2)) * *a.m;", "Q4_1"),
    ("Q4_K q8 product: the second sub-block's min takes the wrong 16-value sums", "quant_k.cu",
     "m2 * (a.s[4 * k + 2] + a.s[4 * k + 3])", "m2 * (a.s[4 * k + 1] + a.s[4 * k + 2])", "Q4_K"),
    ("Q6_K q8 product: the 4th run's high bits from the wrong pair of qh bits", "quant_k.cu",
     "((lo_b >> 4) & 0x0f0f0f0f) | (((h >> 6) & 0x03030303) << 4)", "((lo_b >> 4) & 0x0f0f0f0f) | (((h >> 4) & 0x03030303) << 4)",
     "Q6_K"),
    ("dot4 without __dp4a (devices before sm_61) skips the first byte", "common.cuh",
     "for (int k = 0; k < 32; k += 8) c += (int)(signed char)(a >> k)",
     "for (int k = 8; k < 32; k += 8) c += (int)(signed char)(a >> k)", "dp4a"),
    ("q8_0 KV cache rounds half away from zero (roundf for x86's round-half-to-even)", "kv_quant.cu",
     "__float2int_rn(v * id)", "(int)roundf(v * id)", "quantized_kv"),
    ("q4_0 KV cache: a tie of magnitudes goes to the later value (the scale's sign)", "kv_quant.cu",
     "(o_amax == amax && o_at < at)", "(o_amax == amax && o_at > at)", "quantized_kv"),
    ("q4_0 KV cache rounds x * id + 8.5 to nearest instead of truncating", "kv_quant.cu",
     "(int)__fadd_rn(__fmul_rn(v, id), 8.5f)", "__float2int_rn(__fadd_rn(__fmul_rn(v, id), 8.5f))", "quantized_kv"),
    ("KV cache store: blocks go to the token's index, not its slot (paged layout)", "kv_quant.cu",
     "return cache + slots[t] * blocks_per_tok", "return cache + t * blocks_per_tok", "quantized_kv"),
]


def main() -> int:
    words = sys.argv[1:]
    chosen = [m for m in MUTATIONS if not words or any(w in m[0] for w in words)]
    missed = 0
    for label, file, old, new, only in chosen:
        with tempfile.TemporaryDirectory(prefix="edgellm-mutant-") as tmp:
            for p in SOURCES.glob("*.cu*"):
                shutil.copy(p, tmp)
            path = Path(tmp) / file
            text = path.read_text()
            if old not in text:
                print(f"??      {label}: the text to mutate is no longer in {file}; update this script")
                missed += 1
                continue
            path.write_text(text.replace(old, new, 1))
            env = dict(os.environ, EDGELLM_TEST_CUDA_SOURCES=tmp)
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                str(REPO / "tests" / "test_cuda_emulated.py"), "-k", only],
                               capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
            out = (r.stdout + r.stderr).splitlines()
            caught = r.returncode != 0
            missed += not caught
            print(f"{'CAUGHT' if caught else 'MISSED'}  {label}", flush=True)
            if caught:
                why = [ln for ln in out if ln.startswith("E ") or "cudaemu:" in ln or "Fatal Python" in ln
                       or ln.startswith("FAILED")]
                for ln in why[:2]:
                    print(f"        {ln.strip()[:240]}", flush=True)
    print(f"\n{len(chosen) - missed} of {len(chosen)} planted bugs caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
