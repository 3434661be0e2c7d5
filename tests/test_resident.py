"""Weights copied into huge-page memory (edgellm/resident.py): the same numbers as the mapped
weights, the matrices really in the arena, the file's pages given back, bad values refused."""
import mmap

import numpy as np
import pytest

import edgellm
from edgellm.errors import InvalidArgumentError
from edgellm.resident import CHUNK, HUGE, MIN_BYTES, WeightArena

TOKENS = [1, 504, 3458, 314, 260, 7102, 30, 28, 1204, 4007]


def test_copied_weights_give_the_mapped_logits_bit_for_bit(smollm2_path):
    mapped = edgellm.load(smollm2_path, n_ctx=64, use_mmap=True)
    copied = edgellm.load(smollm2_path, n_ctx=64, use_mmap=False)
    assert mapped.runtime.backends["cpu"].arena is None
    arena = copied.runtime.backends["cpu"].arena
    blocks = copied.runtime.model.blocks
    # every block matrix and the tied embedding table / head live in the arena
    mats = [getattr(L, n) for L in blocks for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                     "ffn_up", "ffn_down")]
    head = copied.runtime.model.output
    assert head is copied.runtime.model.token_embd  # SmolLM2 ties them
    big = [m for m in mats + [head] if m.data.nbytes >= MIN_BYTES]
    assert arena.nbytes == sum(m.data.nbytes for m in big) > 0
    for m in big:
        assert not np.shares_memory(m.data, copied.gf._map)
    np.testing.assert_array_equal(copied.logits(TOKENS), mapped.logits(TOKENS))
    np.testing.assert_array_equal(copied.eval([TOKENS[0]]), mapped.eval([TOKENS[0]]))


def test_arena_copies_big_arrays_aligned_and_leaves_small_ones():
    arena = WeightArena()
    small = np.arange(100, dtype=np.uint8).reshape(10, 10)
    assert arena.copy(small) is small
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, size=(300, 4096), dtype=np.uint8)  # 1.2 MiB: packed into a chunk
    b = rng.integers(0, 255, size=(CHUNK // 1024 + 8, 1024), dtype=np.uint8)  # > CHUNK: its own
    ca, cb = arena.copy(a), arena.copy(b)
    np.testing.assert_array_equal(ca, a)
    np.testing.assert_array_equal(cb, b)
    assert ca.ctypes.data % HUGE == 0 and cb.ctypes.data % HUGE == 0
    assert a.any()  # writable memory is never dropped
    c = arena.copy(a)  # the next one in the same chunk, 64-byte aligned after the first
    assert c.ctypes.data == ca.ctypes.data + a.nbytes // 64 * 64 + (64 if a.nbytes % 64 else 0)
    assert arena.nbytes == 2 * a.nbytes + b.nbytes


def test_copying_gives_the_mapped_pages_back(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8).tobytes())
    with open(path, "rb") as fh:
        m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(m, np.uint8)
    assert int(view.sum()) > 0  # every page of the mapping resident now

    def resident_kib():
        entries = open("/proc/self/smaps").read().split(str(path))
        assert len(entries) == 2, "the mapping appears once"
        rss_line = next(line for line in entries[1].splitlines() if line.startswith("Rss:"))
        return int(rss_line.split()[1])

    assert resident_kib() >= 8 << 10
    copy = WeightArena().copy(view.reshape(2048, -1))
    assert resident_kib() < 64  # the file's pages left this process's resident set
    np.testing.assert_array_equal(copy.reshape(-1), np.fromfile(path, np.uint8))


def test_use_mmap_must_be_a_bool(smollm2_path):
    with pytest.raises(InvalidArgumentError, match="use_mmap"):
        edgellm.load(smollm2_path, n_ctx=64, use_mmap="no")


def test_steps_from_any_thread_run_on_one_kernel_thread_with_the_models_count(smollm2_path):
    """Numba's thread count and OpenMP's thread team are per calling thread: the steps of callers
    on several threads (eval here, and generate from four at once) all run on the one kernel
    thread, with `threads` (not every core) and without touching the callers' own counts."""
    import threading

    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a machine with at least 2 cores for the counts to differ")
    m = edgellm.load(smollm2_path, n_ctx=64, n_seq=4, threads=1)
    seen, inner = [], []
    forward = m.runtime._forward

    def spy(*args):
        inner.append((threading.current_thread().name, numba.get_num_threads()))
        return forward(*args)

    m.runtime._forward = spy

    def work():
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # a fresh thread's own count
        m.eval([1, 2])
        seen.append(numba.get_num_threads())

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert seen == [numba.config.NUMBA_NUM_THREADS] and inner == [("edgellm-kernels", 1)]
    inner.clear()
    texts = [None] * 4
    ths = [threading.Thread(target=lambda i=i: texts.__setitem__(i, "".join(
        c.text for c in m.generate(f"Count to {i + 3}:", max_tokens=6, temperature=0)))) for i in range(4)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert all(texts) and len(inner) >= 6 and set(inner) == {("edgellm-kernels", 1)}
    m.close()


def test_resident_q4_k_rows_are_packed_into_the_arena(gemma3_path, monkeypatch):
    """With the arena (the default where huge pages exist) a mapped Q4_K matrix is packed by eight
    (Matrix.pack) straight into it instead of copied as it is: the products read the packed copy
    in huge-page memory, the QMatrix keeps the file's rows, and the logits are the mapped model's
    and the unpacked kernels' bit for bit."""
    from gguf import GGMLQuantizationType as T

    from edgellm.kernels.cpu import Matrix

    copied = edgellm.load(gemma3_path, n_ctx=64, use_mmap=False)
    mapped = edgellm.load(gemma3_path, n_ctx=64, use_mmap=True)
    cpu = copied.runtime.backends["cpu"]
    arena = cpu.arena
    chunks = [np.frombuffer(c, np.uint8) for c in arena._chunks]
    mats = [w for L in copied.runtime.model.blocks for w in vars(L).values()
            if hasattr(w, "ggml_type") and hasattr(w, "n_rows")]
    q4k = [w for w in mats if w.ggml_type == T.Q4_K]
    assert q4k and all(w.n_rows % 8 == 0 for w in q4k)
    packed_bytes = 0
    for w in q4k:
        m = cpu._matrix(w)
        assert m.packed is not None and m.weights is m.packed
        assert m.packed.shape == (w.n_rows, w.data.shape[1] // 36 * 37)
        assert any(np.shares_memory(m.packed, c) for c in chunks)  # in the arena
        assert np.shares_memory(w.data, copied.gf._map)  # the QMatrix keeps the rows
        packed_bytes += m.packed.nbytes
    others = [w for w in mats if w.ggml_type != T.Q4_K and w.data.nbytes >= MIN_BYTES]
    assert all(not np.shares_memory(w.data, copied.gf._map) for w in others)
    head = copied.runtime.model.output
    head_bytes = head.data.nbytes if not np.shares_memory(head.data, copied.gf._map) else 0
    assert arena.nbytes == packed_bytes + sum(w.data.nbytes for w in others) + head_bytes
    logits = copied.logits(TOKENS)
    np.testing.assert_array_equal(logits, mapped.logits(TOKENS))
    np.testing.assert_array_equal(copied.eval([TOKENS[0]]), mapped.eval([TOKENS[0]]))
    monkeypatch.setattr(Matrix, "pack", lambda self, alloc=None: False)
    plain = edgellm.load(gemma3_path, n_ctx=64, use_mmap=False)
    assert all(plain.runtime.backends["cpu"]._matrix(w).packed is None
               for L in plain.runtime.model.blocks for w in vars(L).values()
               if getattr(w, "ggml_type", None) == T.Q4_K)
    np.testing.assert_array_equal(plain.logits(TOKENS), logits)
