"""Facts about this machine that sizing and reports read: the CPU and its SIMD flags, the largest
cache, the memory read rate (a stream test, cached per machine), idle cores, transparent huge pages."""
from __future__ import annotations

from pathlib import Path


def machine() -> dict:
    import os
    import platform

    import psutil

    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":")[1].split())
                    flags = " ".join(x for x in ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                                 "avx512_vnni", "avx_vnni", "amx_int8") if x in have)
                    break
    except OSError:
        pass
    return {
        "cpu": platform.processor() or platform.machine(),
        "physical_cores": psutil.cpu_count(logical=False),
        "logical_cores": os.cpu_count(),
        "simd": flags,
        "memory_bytes": psutil.virtual_memory().total,
    }


def last_level_cache_bytes() -> int:
    """Bytes of the largest CPU cache (Linux sysfs; 0 where it is not there)."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (d / "type").read_text().strip() == "Instruction":
                continue
            size = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


STREAM_MIN_BYTES = 256 << 20


def stream_bytes(cache: int | None = None, available: int | None = None) -> int:
    """Size of the stream test's array: twice the largest cache (an array that fits in it measures
    the cache, not the memory: docs/performance.md), at least STREAM_MIN_BYTES, at most a quarter
    of the available memory."""
    import psutil

    cache = last_level_cache_bytes() if cache is None else cache
    available = psutil.virtual_memory().available if available is None else available
    n = max(STREAM_MIN_BYTES, 2 * cache)
    return max(64 << 20, min(n, available // 4)) // 64 * 64


def stream_bandwidth(threads: int, n_bytes: int | None = None, reps: int = 5) -> float:
    """Bytes/s the machine reads from memory: `threads` threads summing their slices of an array
    larger than the caches (stream_bytes; NumPy releases the GIL), best of `reps`."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    a = np.ones((n_bytes or stream_bytes()) // 8, np.uint64)
    parts = np.array_split(a, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def machine_bandwidth(threads: int) -> float:
    """stream_bandwidth, measured once per machine and thread count and cached in the user cache
    (bandwidth.json; delete it to measure again)."""
    import json
    import platform

    from edgellm.fetch import cache_dir

    path = cache_dir() / "bandwidth.json"
    # the largest cache is in the key: a rate measured before the array outgrew it is measured again
    key = f"{platform.node()}:{platform.processor() or platform.machine()}:{threads}:llc{last_level_cache_bytes() >> 20}M"
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = stream_bandwidth(threads)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(cached, indent=1))
        except OSError:
            pass  # a read-only cache: measured again next time
    return float(cached[key])


def idle_cores(sample_s: float = 0.05) -> float | None:
    """How many CPU cores sat idle over the next sample_s seconds (sum of the per-CPU idle
    fractions from /proc/stat; None where there is none). Threads that share a core with another
    busy process wait at every parallel region's barrier for a time slice (decode runs ~5 regions
    a layer: with one of two cores busy, two threads decode several times slower than one), so
    the default thread count stays within the idle cores."""
    import time

    def read() -> dict:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
        return {r[0]: (int(r[4]) + int(r[5]), sum(int(v) for v in r[1:9])) for r in rows}

    try:
        a = read()
        time.sleep(sample_s)
        b = read()
    except (OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu_name, (idle1, total1) in b.items():
        idle0, total0 = a.get(cpu_name, (idle1, total1))
        if total1 > total0:
            idle += (idle1 - idle0) / (total1 - total0)
    return idle if b else None


def huge_pages_available() -> bool:
    """True when the kernel gives transparent huge pages to memory that asks (madvise or always)."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode
