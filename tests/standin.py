"""A stand-in for the GPU backend: the CPU ops, but a device of its own with copies on upload and at
every host crossing, so the hybrid orchestration (layer map, KV placement, crossings, per-device
accounting) runs without a GPU."""
from __future__ import annotations

import numpy as np

from edgellm.backend import QMatrix
from edgellm.kernels.cpu.backend import CPUBackend


class StandInGPU(CPUBackend):
    device = "gpu"

    def __init__(self, threads=None):
        super().__init__(threads)
        self.uploaded = 0
        self.crossings = 0

    def weight(self, t):
        w = super().weight(t)
        if isinstance(w, QMatrix):
            data = np.array(w.data)  # "upload": a private copy, not the mapped file
            self.uploaded += data.nbytes
            return QMatrix(w.ggml_type, data, w.n_rows, w.n_cols, w.name)
        self.uploaded += w.nbytes
        return w.copy()

    def from_host(self, x):
        self.crossings += 1
        return np.array(x, copy=True)

    def to_host(self, x):
        return np.array(x, copy=True)
