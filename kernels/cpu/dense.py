"""Float weight types: F32 (BLAS through NumPy), F16 and BF16 (Numba, converted on the fly).

raw uint8 (n_rows, n_cols * 4 | 2); products are float32 dot products over whole rows.
F16 -> F32 is exact (common.f16_to_f32), BF16 -> F32 is a shift: dequantize is bit-exact.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, JIT, U, bf16_to_f32, f16_to_f32, njit, prange


@njit(**JIT)
def dequantize_f16(raw, out):
    for r in prange(raw.shape[0]):
        row, dst = raw[r], out[r]
        for j in range(U(out.shape[1])):
            dst[j] = f16_to_f32(row[j + j], row[j + j + U(1)])


@njit(**JIT)
def dequantize_bf16(raw, out):
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
            acc += f16_to_f32(row[j + j], row[j + j + U(1)]) * x[j]
        out[r] = acc


@njit(fastmath=True, **JIT)
def matvec_bf16(raw, x, out):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for j in range(U(x.size)):
            acc += bf16_to_f32(row[j + j], row[j + j + U(1)]) * x[j]
        out[r] = acc


class DenseOps:
    """F32 goes to NumPy (BLAS); F16 / BF16 to the kernels above."""

    kernels = {
        GGMLType.F16: (dequantize_f16, matvec_f16),
        GGMLType.BF16: (dequantize_bf16, matvec_bf16),
    }

    def dequantize(self, ggml_type, raw, out):
        if ggml_type == GGMLType.F32:
            np.copyto(out, raw.view(np.float32))
        else:
            self.kernels[ggml_type][0](raw, out)

    def matvec(self, ggml_type, raw, x, out):
        if ggml_type == GGMLType.F32:
            np.matmul(raw.view(np.float32), x, out=out)
        else:
            self.kernels[ggml_type][1](raw, x, out)


OPS = DenseOps()
