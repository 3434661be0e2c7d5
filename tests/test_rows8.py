"""The eight-row decode kernels (kernels/cpu/ir/rows8.py, ir/packed.py) and the Q4_0 eight-rows x four-tokens prompt
tile give each row the one-row kernel's result bit for bit (same float order), including the rows
and tokens left over after the groups of eight rows / four tokens."""
import functools

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GGMLType
from quant_blocks import random_rows

# The kernels are imported when a test runs, not at collection: a pytest process that loaded
# numba (LLVM) while collecting would share libllvmlite's pages with every subprocess a test starts,
# and the ledger test's check that a model hands LLVM's pages back would see them stay resident.


@functools.lru_cache(maxsize=1)
def kernels():
    from edgellm.kernels import cpu
    from edgellm.kernels.cpu.common import U, njit
    from edgellm.kernels.cpu.kquants import row_q4_k
    from edgellm.kernels.cpu.legacy import row_q4_0
    from edgellm.kernels.cpu.ir.legacy import rowdot_q5_0, rowdot_q8_0

    @njit(cache=False)
    def one_row_products(kind, raw, xq, xd, xs, n_tok, out):
        """out (n_tok, n_rows): every (token, row) by the one-row kernel, row after row."""
        nb = U(xd.size // n_tok)
        for t in range(n_tok):
            for r in range(raw.shape[0]):
                if kind == 0:
                    out[t, r] = row_q4_0(raw[r], xq, xd, xs, U(t), nb)
                elif kind == 2:
                    out[t, r] = rowdot_q8_0(raw[r], U(0), xq, U(t) * nb * U(32), xd, U(t) * nb, nb)
                elif kind == 1:
                    out[t, r] = row_q4_k(raw[r], xq, xd, xs, U(t), nb, False)
                elif kind == 4:
                    out[t, r] = rowdot_q5_0(raw[r], U(0), xq, U(t) * nb * U(32), xd, U(t) * nb, nb)
                else:  # Q4_K in a batch: llama.cpp's four-token order for the groups of four
                    out[t, r] = row_q4_k(raw[r], xq, xd, xs, U(t), nb, t < n_tok - n_tok % 4)

    return cpu, one_row_products


def activations(t, x):
    cpu, one_row_products = kernels()
    xa = cpu.quantize(cpu.activation_format(t), x.reshape(-1))
    return xa.parts


@pytest.mark.parametrize("t", [GGMLType.Q4_0, GGMLType.Q4_K, GGMLType.Q8_0, GGMLType.Q5_0], ids=lambda t: t.name)
@pytest.mark.parametrize("n_rows", [8, 45, 131])
def test_matvec_eight_rows_equal_the_one_row_kernel(t, n_rows):
    cpu, one_row_products = kernels()
    rng = np.random.default_rng(n_rows)
    n_cols = 2048
    raw = random_rows(t, n_rows, n_cols, seed=n_rows)
    x = rng.standard_normal(n_cols).astype(np.float32)
    x[::13] *= 30.0
    out = np.full(n_rows, np.nan, np.float32)
    cpu.matvec(t, raw, x, out)
    xq, xd, xs = activations(t, x)[:3]
    ref = np.full((1, n_rows), np.nan, np.float32)
    one_row_products({GGMLType.Q4_0: 0, GGMLType.Q4_K: 1, GGMLType.Q8_0: 2, GGMLType.Q5_0: 4}[t], raw, xq, xd, xs, 1,
                     ref)
    assert np.array_equal(out.view(np.uint32), ref[0].view(np.uint32))


@pytest.mark.parametrize("n_tok", [4, 6, 11])
def test_q4_0_prompt_tiles_equal_the_one_row_kernel(n_tok):
    cpu, one_row_products = kernels()
    rng = np.random.default_rng(n_tok)
    n_rows, n_cols = 37, 1024
    raw = random_rows(GGMLType.Q4_0, n_rows, n_cols, seed=n_tok)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, ::11] *= 25.0
    m = cpu.bind(GGMLType.Q4_0, raw, n_cols)
    xa = m.quantize_batch(x)
    out = np.full((n_tok, n_rows), np.nan, np.float32)
    assert m.matmul_act(xa, out)
    ref = np.full((n_tok, n_rows), np.nan, np.float32)
    xq, xd, xs = xa.parts[:3]
    one_row_products(0, raw, xq, xd, xs, n_tok, ref)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("n_tok", [1, 3, 4, 9, 14])
def test_packed_q4_k_products_equal_the_one_row_kernel(n_tok):
    """Q4_K rows packed by eight (Matrix.pack: each row a lane of the kernels' vectors, the form
    CPUBackend multiplies mapped Q4_K weights in) give every (token, row) the unpacked kernels'
    result: decode (one token) and batches with groups of four tokens and leftovers."""
    cpu, one_row_products = kernels()
    rng = np.random.default_rng(100 + n_tok)
    n_rows, n_cols = 48, 1536
    raw = random_rows(GGMLType.Q4_K, n_rows, n_cols, seed=n_tok)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, ::17] *= 40.0
    m = cpu.bind(GGMLType.Q4_K, raw, n_cols)
    assert m.pack() and m.packed.shape == (n_rows, raw.shape[1] * 37 // 36)
    assert not np.array_equal(m.packed[:8, :64], raw[:8, :64])  # another layout, not a copy
    out = np.full((n_tok, n_rows), np.nan, np.float32)
    m.matmul(x, out)
    xa = m.quantize_batch(x)
    ref = np.full((n_tok, n_rows), np.nan, np.float32)
    one_row_products(3, raw, *xa.parts[:3], n_tok, ref)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    if n_tok > 1:  # the batch entry the engine calls
        again = np.full((n_tok, n_rows), np.nan, np.float32)
        assert m.matmul_act(xa, again)
        assert np.array_equal(again.view(np.uint32), ref.view(np.uint32))


def test_pack_only_q4_k_with_whole_groups_of_eight_rows():
    cpu, _ = kernels()
    assert not cpu.bind(GGMLType.Q4_K, random_rows(GGMLType.Q4_K, 45, 512, seed=1), 512).pack()
    assert not cpu.bind(GGMLType.Q4_0, random_rows(GGMLType.Q4_0, 48, 512, seed=1), 512).pack()


def test_outlined_kernels_are_calls_of_their_own_with_the_same_bits():
    """fused.decode_layers calls its K-quant row kernels as functions of their own
    (common.outlined), not inlined into it (inlined among the other types' kernels they spilled
    registers and ran 10-40 % slower): the caller's code calls a noinline function, and every row
    gets the inlined kernel's result bit for bit."""
    import re

    from edgellm.kernels.cpu import fused, kquants
    from edgellm.kernels.cpu.ir import kquants as ir_kquants
    from edgellm.kernels.cpu.ir import packed as ir_packed
    from edgellm.kernels.cpu.common import U, njit

    cpu, _ = kernels()
    rng = np.random.default_rng(7)
    n_rows, n_cols = 24, 1024
    x = rng.standard_normal(n_cols).astype(np.float32)
    x[::11] *= 25.0
    q4 = random_rows(GGMLType.Q4_K, n_rows, n_cols, seed=3)
    packed = kquants.pack8_q4_k(q4)
    q6 = random_rows(GGMLType.Q6_K, n_rows, n_cols, seed=4)
    xq, xd, xs = activations(GGMLType.Q4_K, x)[:3]
    nb = U(n_cols // 256)

    def products(il8, q6k):
        @njit(cache=False)
        def run(packed, q6, xq, xd, xs, out4, out6):
            for g in range(packed.shape[0] // 8):
                il8(packed, U(g) * U(8) * U(packed.shape[1]), xq, xd, xs, U(0), nb, out4, U(8 * g))
            for r in range(q6.shape[0]):
                out6[r] = q6k(q6, U(r) * U(q6.shape[1]), xq, U(0), xd, xs, U(0), nb)

        out4, out6 = np.full(n_rows, np.nan, np.float32), np.full(n_rows, np.nan, np.float32)
        run(packed, q6, xq, xd, xs, out4, out6)
        return run, out4, out6

    inl, in4, in6 = products(ir_packed.il8_q4_k, ir_kquants.rowdot_q6_k)
    out, out4, out6 = products(fused.il8_q4_k, fused.rowdot_q6_k)
    assert np.array_equal(in4.view(np.uint32), out4.view(np.uint32)) and not np.isnan(in4).any()
    assert np.array_equal(in6.view(np.uint32), out6.view(np.uint32)) and not np.isnan(in6).any()
    ir_out, ir_in = out.inspect_llvm(out.signatures[0]), inl.inspect_llvm(inl.signatures[0])
    names = set(re.findall(r"define internal [^@]*@\"?(edgellm\.[\w.]+)\"?\(", ir_out))
    assert {n.split(".")[1] for n in names} == {"il8_q4_k", "rowdot_q6_k"}, names
    assert all(re.search(rf"call [^@]*@\"?{re.escape(n)}\"?\(", ir_out) for n in names)  # called, not inlined
    assert "edgellm." not in ir_in  # the plain intrinsics stay inlined


@pytest.mark.parametrize("n_tok", [2, 3, 4])
def test_several_tokens_over_packed_q4_k_get_each_ones_bits(n_tok):
    """il8x2 / il8x3 / il8n4_q4_k (a verification step's rows: the weights read once for two to
    four tokens) give each token il8_q4_k's result alone, bit for bit, and so the one-row kernel's."""
    from edgellm.kernels.cpu import kquants
    from edgellm.kernels.cpu.ir import packed as ir_packed
    from edgellm.kernels.cpu.common import U, njit

    cpu, one_row_products = kernels()
    rng = np.random.default_rng(300 + n_tok)
    n_rows, n_cols = 24, 1536
    raw = random_rows(GGMLType.Q4_K, n_rows, n_cols, seed=20 + n_tok)
    packed = kquants.pack8_q4_k(raw)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, ::13] *= 30.0
    xq, xd, xs = cpu.bind(GGMLType.Q4_K, raw, n_cols).quantize_batch(x).parts[:3]
    many = {2: ir_packed.il8x2_q4_k, 3: ir_packed.il8x3_q4_k, 4: ir_packed.il8n4_q4_k}[n_tok]
    nb, rb = U(n_cols // 256), U(packed.shape[1])

    @njit(cache=False)
    def run(packed, xq, xd, xs, alone, together):
        for g in range(packed.shape[0] // 8):
            for t in range(n_tok):
                ir_packed.il8_q4_k(packed, U(8 * g) * rb, xq, xd, xs, U(t) * nb, nb, alone, U(t * n_rows + 8 * g))
            many(packed, U(8 * g) * rb, xq, xd, xs, U(0), nb, together, U(8 * g), U(n_rows))

    alone, together = (np.full(n_tok * n_rows, np.nan, np.float32) for _ in range(2))
    run(packed, xq, xd, xs, alone, together)
    ref = np.full((n_tok, n_rows), np.nan, np.float32)
    one_row_products(1, raw, xq, xd, xs, n_tok, ref)
    assert not np.isnan(together).any()
    assert np.array_equal(together.view(np.uint32), alone.view(np.uint32))
    assert np.array_equal(together.view(np.uint32), ref.reshape(-1).view(np.uint32))


@pytest.mark.parametrize("n_tok", [2, 3, 4, 5, 7])
def test_q6_k_rows_for_several_tokens_get_each_ones_bits(n_tok):
    """rows_q6_k (a verification step's head and Q6_K rows: each row unpacked once for up to four
    tokens, ir.kquants.rowdotx2 / x4_q6_k) gives every (token, row) rowdot_q6_k's one-token result."""
    from edgellm.kernels.cpu import kquants
    from edgellm.kernels.cpu.common import U, njit
    from edgellm.kernels.cpu.ir.kquants import rowdot_q6_k

    cpu, _ = kernels()
    rng = np.random.default_rng(400 + n_tok)
    n_rows, n_cols = 37, 1536
    raw = random_rows(GGMLType.Q6_K, n_rows, n_cols, seed=40 + n_tok)
    x = rng.standard_normal((n_tok, n_cols)).astype(np.float32)
    x[:, ::7] *= 20.0
    xq, xd, xs, xm = cpu.bind(GGMLType.Q6_K, raw, n_cols).quantize_batch(x).parts[:4]
    got = np.full((n_tok, n_rows), np.nan, np.float32)
    kquants.rows_q6_k(raw, xq, xd, xs, xm, got)

    @njit(cache=False)
    def one_by_one(raw, xq, xd, xs, out):
        nb = U(xd.size // out.shape[0])
        for t in range(out.shape[0]):
            for r in range(raw.shape[0]):
                out[t, r] = rowdot_q6_k(raw[r], U(0), xq, U(t) * nb * U(256), xd, xs, U(t) * nb, nb)

    ref = np.full((n_tok, n_rows), np.nan, np.float32)
    one_by_one(raw, xq, xd, xs, ref)
    assert not np.isnan(got).any() and np.array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("n_cols", [896, 2048])
def test_q5_0_rows_by_eight_equal_the_one_row_kernel(n_cols):
    """rows8_q5_0 (the decode step's Q5_0 rows, eight at a time: Qwen2.5-0.5B's 896-wide rows are
    Q5_0 in its Q4_K_M file) gives each row rowdot_q5_0's result bit for bit."""
    from edgellm.kernels.cpu.ir import rows8
    from edgellm.kernels.cpu.common import U, njit
    from edgellm.kernels.cpu.ir.legacy import rowdot_q5_0

    cpu, _ = kernels()
    rng = np.random.default_rng(n_cols)
    n_rows = 24
    raw = random_rows(GGMLType.Q5_0, n_rows, n_cols, seed=n_cols)
    x = rng.standard_normal(n_cols).astype(np.float32)
    x[::9] *= 25.0
    xq, xd = activations(GGMLType.Q5_0, x)[:2]
    nb, rb = U(n_cols // 32), U(raw.shape[1])

    @njit(cache=False)
    def run(raw, xq, xd, eight, one):
        flat = raw.reshape(-1)
        for g in range(raw.shape[0] // 8):
            rows8.rows8_q5_0(flat, U(8 * g) * rb, rb, xq, U(0), xd, U(0), nb, eight, U(8 * g))
        for r in range(raw.shape[0]):
            one[r] = rowdot_q5_0(flat, U(r) * rb, xq, U(0), xd, U(0), nb)

    eight, one = np.full(n_rows, np.nan, np.float32), np.full(n_rows, np.nan, np.float32)
    run(raw, xq, xd, eight, one)
    assert not np.isnan(eight).any() and np.array_equal(eight.view(np.uint32), one.view(np.uint32))
