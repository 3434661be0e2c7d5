"""Float weight types F16 and BF16 (Numba, converted on the fly); F32 goes to NumPy (BLAS).

raw uint8 (n_rows, n_cols * 2); `matvec_<t>(raw, xr, out)` takes x already rounded to the
weight's type (llama.cpp converts x to F16 / BF16 before the product: common.quantize_f16 /
quantize_bf16). When the row length is a multiple of 32 the sums follow llama.cpp's order
(ir.dense.dot_f16 / dot_bf16): one token as ggml's vec_dot_f16 / vec_dot_bf16 (four 8-lane fma
accumulators), two or more as its tinyBLAS product (one 8-lane accumulator); other lengths sum
float32 products in SIMD lanes of LLVM's choosing.
F16 -> F32 is exact (common.f16_to_f32), BF16 -> F32 is a shift: dequantize is bit-exact.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as GGMLType

from edgellm.kernels.cpu.common import F32, JIT, U, bf16_to_f32, f16_to_f32, load_f16, njit, prange
from edgellm.kernels.cpu.ir.dense import dot_bf16, dot_f16


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
def _matvec_f16_any(raw, x, out):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for j in range(U(x.size)):
            acc += load_f16(row, j + j) * x[j]
        out[r] = acc


@njit(fastmath=True, **JIT)
def _matvec_bf16_any(raw, x, out):
    for r in prange(raw.shape[0]):
        row = raw[r]
        acc = F32(0.0)
        for j in range(U(x.size)):
            acc += bf16_to_f32(row[j + j], row[j + j + U(1)]) * x[j]
        out[r] = acc


@njit(inline="always")
def _dot(bf16, row, x, x_off, n, n_acc):
    if bf16:
        return dot_bf16(row, U(0), x, x_off, n, n_acc)
    return dot_f16(row, U(0), x, x_off, n, n_acc)


@njit(**JIT)
def _matvec_ggml(raw, x, out, bf16):
    """One token: vec_dot_f16 / vec_dot_bf16's order (four 8-lane accumulators)."""
    for r in prange(raw.shape[0]):
        out[r] = _dot(bf16, raw[r], x, U(0), U(x.size), 4)


ROW_CHUNK = 16  # matmul: rows per parallel chunk


@njit(**JIT)
def _matmul_ggml(raw, x, out, bf16):
    """Two or more tokens: tinyBLAS's order (one 8-lane accumulator)."""
    n_tok, n_rows = out.shape
    n = U(x.size // n_tok)
    for c in prange((n_rows + ROW_CHUNK - 1) // ROW_CHUNK):
        for r in range(c * ROW_CHUNK, min(c * ROW_CHUNK + ROW_CHUNK, n_rows)):
            for t in range(n_tok):
                out[t, r] = _dot(bf16, raw[r], x, U(t) * n, n, 1)


def _in_ggml_order(ggml_order, any_order, bf16: bool, per_token: bool):
    """Dispatch on the row length: ggml's order when it is a multiple of 32 (else `any_order`,
    applied token by token for a batch)."""
    def product(raw, x, out):
        if (raw.shape[1] // 2) % 32 == 0:
            ggml_order(raw, x, out, bf16)
        elif per_token:
            n = raw.shape[1] // 2
            for t in range(out.shape[0]):
                any_order(raw, x[t * n:(t + 1) * n], out[t])
        else:
            any_order(raw, x, out)
    return product


KERNELS = {
    GGMLType.F16: (dequantize_f16, _in_ggml_order(_matvec_ggml, _matvec_f16_any, False, False)),
    GGMLType.BF16: (dequantize_bf16, _in_ggml_order(_matvec_ggml, _matvec_bf16_any, True, False)),
}
MATMUL = {
    GGMLType.F16: _in_ggml_order(_matmul_ggml, _matvec_f16_any, False, True),
    GGMLType.BF16: _in_ggml_order(_matmul_ggml, _matvec_bf16_any, True, True),
}
