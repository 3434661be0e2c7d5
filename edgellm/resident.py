"""Weights copied out of the file mapping into anonymous memory backed by transparent huge pages.

Why: a decode step reads every weight of the CPU layers once, ~0.6-5 GB a token at 1B-8B sizes.
Read through the file mapping, that is one 4 KiB page per 4 KiB of weights, and the page walks of
the TLB misses cost up to a fifth of the step (docs/performance.md, standing decisions).
So by default the CPU layers' matrices are copied into 2 MiB-aligned chunks advised
MADV_HUGEPAGE, and the file's pages they came from are dropped from the mapping (MADV_DONTNEED:
they stay in the page cache, not in this process's resident set), so resident memory stays what
it was. `load(mmap=True)` / `--mmap` keeps the weights mapped (less load work for a file that is
not in the page cache, pages shared with other processes); the default copies only when the
kernel offers transparent huge pages and the file takes less than half of the available memory.
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from edgellm.machine import huge_pages_available

HUGE = 2 << 20  # bytes of a transparent huge page (x86-64, arm64 with 4 KiB base pages)
CHUNK = 64 << 20  # matrices are packed into chunks of this size (larger ones get their own)
MIN_BYTES = 16 << 10  # smaller arrays stay mapped (not worth a copy)
SLICE = 4 << 20  # bytes copied between two drops of the source's pages
_MADV_DONTNEED = 4
_libc = None  # ctypes' handle to the C library, for madvise (loaded on first use)


def want_resident(file_bytes: int) -> bool:
    """The default of load(mmap=None): copy when huge pages exist and the file fits easily."""
    if not huge_pages_available() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    import psutil

    return file_bytes < psutil.virtual_memory().available // 2


class WeightArena:
    """Chunks of anonymous memory (2 MiB-aligned, MADV_HUGEPAGE) that weight matrices are copied into."""

    def __init__(self):
        self._chunks: list[mmap.mmap] = []  # kept alive: the views below point into them
        self._cur: np.ndarray | None = None
        self._used = 0
        self.nbytes = 0  # bytes of weights copied

    def _alloc(self, n: int) -> np.ndarray:
        size = (n + HUGE - 1) // HUGE * HUGE + HUGE  # + one page to align the start
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf = np.frombuffer(m, np.uint8)
        start = (-buf.ctypes.data) % HUGE
        try:
            m.madvise(mmap.MADV_HUGEPAGE, start, size - start)
        except (AttributeError, OSError, ValueError):
            pass  # no huge pages: still a private copy, no worse than the mapping
        self._chunks.append(m)
        return buf[start:start + (size - HUGE)]

    def _take(self, n: int) -> np.ndarray:
        """n bytes of the arena (64-byte aligned), uint8, not initialized."""
        if n > CHUNK:
            return self._alloc(n)[:n]
        if self._cur is None or self._used + n > self._cur.size:
            self._cur, self._used = self._alloc(CHUNK), 0
        dst = self._cur[self._used:self._used + n]
        self._used += (n + 63) // 64 * 64
        return dst

    def empty(self, shape) -> np.ndarray:
        """A uint8 array of `shape` in the arena, not initialized (what Q4_K rows are packed into)."""
        n = int(np.prod(shape))
        self.nbytes += n
        return self._take(n).reshape(shape)

    def copy(self, data: np.ndarray) -> np.ndarray:
        """data copied into the arena. When data is read-only (a view of a file mapped for reading:
        GGUFFile's), the mapping's pages of it are dropped; writable memory is left alone (dropping
        anonymous pages would zero them). Small arrays come back as they are."""
        n = data.nbytes
        if n < MIN_BYTES or not data.flags.c_contiguous:
            return data
        out = self._take(n).view(data.dtype).reshape(data.shape)
        # in slices, each slice's source pages dropped right after it is copied: the file's pages
        # and the copy are resident together for one slice, not for a whole (say 180 MiB) matrix
        src, flat = data.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8)
        drop = not data.flags.writeable
        for i in range(0, n, SLICE):
            np.copyto(flat[i:i + SLICE], src[i:i + SLICE])
            if drop:
                drop_pages(src[i:i + SLICE])
        self.nbytes += n
        return out


def drop_pages(data: np.ndarray) -> None:
    """madvise(MADV_DONTNEED) on the whole pages inside data's bytes (a read-only file mapping: the
    pages leave this process's resident set and stay in the page cache)."""
    page = mmap.PAGESIZE
    a = data.ctypes.data
    lo, hi = (a + page - 1) // page * page, (a + data.nbytes) // page * page
    if hi > lo:
        global _libc
        try:
            if _libc is None:
                _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(_MADV_DONTNEED))
        except (OSError, AttributeError):
            pass
