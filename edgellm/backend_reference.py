"""Reference backend: every weight dequantized once to float32 with gguf's NumPy dequantizer, products
in NumPy. Slow and memory-hungry, obviously correct: the whole-model twin the fast backends are
tested against."""
from __future__ import annotations

import numpy as np

from edgellm.kernels.cpu.numpy_backend import NumpyBackend
from edgellm.gguf_file import TensorInfo


class ReferenceBackend(NumpyBackend):
    device = "cpu"

    def weight(self, t: TensorInfo):
        if len(t.ne) == 1:
            return np.ascontiguousarray(t.as_float32().reshape(-1))
        return np.ascontiguousarray(t.qtype.dequantize_reference(t.data).reshape(t.shape), dtype=np.float32)

    def embed(self, w: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
        out[:] = w[ids]

    def linear(self, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
        np.matmul(x, w.T, out=out)
