"""The CUDA executor's own tests: warp intrinsics against the PTX shfl.sync rules computed in NumPy,
dynamic shared memory and __syncthreads_count, __half conversions bit-exact against NumPy, atomics,
and the errors it must raise (divergent barrier, __launch_bounds__, argument types, partial warps).
Kernels: tests/data/cudaemu_selftest.cu."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from edgellm.kernels.cuda.emulator.executor import EmuError, EmuModule

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA executor needs g++")


@pytest.fixture(scope="module")
def m():
    return EmuModule(path=Path(__file__).parent / "data" / "cudaemu_selftest.cu")


@pytest.mark.parametrize("width", [32, 16, 8, 4])
def test_shuffles_ballot_any_all_follow_ptx(m, width):
    rng = np.random.default_rng(width)
    v = rng.integers(0, 100, 128).astype(np.int32)
    out = np.zeros((6, 128), np.int32)
    m.get_function("shuffles")((1,), (128,), (v, out, np.int32(width)))
    t = np.arange(128)
    lane = t % 32
    base = t - lane
    seg = lane // width * width
    j = lane ^ 9
    ballot = np.array([sum(int(v[w * 32 + k] & 1) << k for k in range(32)) for w in range(4)], np.uint32)
    np.testing.assert_array_equal(out[0], v[base + seg + 3 % width])  # idx: lane 3 of the segment
    np.testing.assert_array_equal(out[1], v[np.where(lane - seg >= 2, t - 2, t)])  # up 2, clamped
    np.testing.assert_array_equal(out[2], v[np.where(lane - seg + 5 < width, t + 5, t)])  # down 5, clamped
    np.testing.assert_array_equal(out[3], v[np.where(j <= seg + width - 1, base + j, t)])  # xor 9
    np.testing.assert_array_equal(out[4], np.repeat(ballot, 32).view(np.int32))
    np.testing.assert_array_equal(out[5], np.repeat([int((v[w * 32:w * 32 + 32] == 77).any()) + 2
                                                     for w in range(4)], 32))


def test_dynamic_shared_memory_and_syncthreads_count(m):
    rng = np.random.default_rng(0)
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    out = np.zeros(4, np.float32)
    counts = np.zeros(4, np.int32)
    m.get_function("block_sum")((4,), (256,), (x, out, counts, np.int32(n)), shared_mem=256 * 4)
    want = np.array([x[i * 256:(i + 1) * 256].astype(np.float64).sum() for i in range(4)])
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert list(counts) == [256, 256, 256, 1000 - 3 * 256]


def test_half_conversions_are_bit_exact(m):
    rng = np.random.default_rng(1)
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = every[np.isfinite(every)].astype(np.float32)
    scales = (1e-7, 1e-5, 1.0, 1e3, 7e4)  # subnormals to overflow
    rand = np.concatenate([rng.standard_normal(20000).astype(np.float32) * s for s in scales])
    for xs in (finite, rand):
        h = np.zeros(xs.size, np.uint16)
        back = np.zeros(xs.size, np.float32)
        m.get_function("half_roundtrip")(((xs.size + 255) // 256,), (256,), (xs, h, back, np.int32(xs.size)))
        with np.errstate(over="ignore"):
            want = xs.astype(np.float16)
        np.testing.assert_array_equal(h, want.view(np.uint16))
        np.testing.assert_array_equal(back, want.astype(np.float32))


def test_atomics(m):
    c, f = np.zeros(1, np.int32), np.zeros(1, np.float32)
    m.get_function("atomics")((3,), (64,), (c, f))
    assert c[0] == 192 and f[0] == 96.0


@pytest.mark.parametrize("kernel,grid_block,args,message", [
    ("divergent_barrier", (32,), lambda n: (np.zeros(n, np.int32),), "divergent barrier"),
    ("shuffles", (256,), lambda n: (np.zeros(n, np.int32), np.zeros(6 * n, np.int32), np.int32(32)),
     "__launch_bounds__(128)"),
    ("shuffles", (128,), lambda n: (np.zeros(n, np.int32), np.zeros(6 * n, np.int32), 32), "argument 2 is given as i8"),
    ("shuffles", (48,), lambda n: (np.zeros(n, np.int32), np.zeros(6 * n, np.int32), np.int32(32)),
     "names lanes that do not exist"),
    ("early_exit_before_shuffle", (32,), lambda n: (np.zeros(n, np.int32),), "lane 0 of the warp has exited"),
], ids=["divergent-barrier", "launch-bounds", "argument-type", "partial-warp-full-mask", "exited-lane-in-mask"])
def test_errors_are_reported(m, kernel, grid_block, args, message):
    m.set_options(order="forward")  # lane 0 runs (and exits) first
    with pytest.raises(EmuError, match=message.replace("(", r"\(").replace(")", r"\)")):
        m.get_function(kernel)((1,), grid_block, args(grid_block[0]))
