"""Float weight types F16 and BF16 (Numba, converted on the fly); F32 goes to NumPy (BLAS).

raw uint8 (n_rows, n_cols * 2); `matvec_<t>(raw, xr, out)` takes x already rounded to the
weight's type (llama.cpp converts x to F16 / BF16 before the product: common.quantize_f16 /
quantize_bf16) and sums float32 products over whole rows.
F16 -> F32 is exact (common.f16_to_f32), BF16 -> F32 is a shift: dequantize is bit-exact.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, JIT, U, bf16_to_f32, f16_to_f32, load_f16, njit, prange


@njit(**JIT)
def dequantize_f16(raw, out, lanes):  # lanes: unused, the signature all families share
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for j in range(U(out.shape[1])):
            dst[j] = f16_to_f32(row[j + j], row[j + j + U(1)])


@njit(**JIT)
def dequantize_bf16(raw, out, lanes):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for j in range(U(out.shape[1])):
            dst[j] = bf16_to_f32(row[j + j], row[j + j + U(1)])


# Reassociation lets LLVM split each row's sum into SIMD lanes; the split is fixed at compile
# time, so repeated calls still give the same bits.
@njit(fastmath=True, **JIT)
def matvec_f16(raw, x, out):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for j in range(U(x.size)):
            acc += load_f16(row, j + j) * x[j]
        out[r] = acc


@njit(fastmath=True, **JIT)
def matvec_bf16(raw, x, out):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for j in range(U(x.size)):
            acc += bf16_to_f32(row[j + j], row[j + j + U(1)]) * x[j]
        out[r] = acc


KERNELS = {
    GGMLType.F16: (dequantize_f16, matvec_f16),
    GGMLType.BF16: (dequantize_bf16, matvec_bf16),
}
