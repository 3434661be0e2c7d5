"""CPU backend: the ops model code calls (the interface: edgellm.backend.Backend) as Numba kernels
(kernels/cpu/ops.py, attention.py, flash.py and the type families), with the decoder's steps fused
(`linear_many`, `qkv_attention`, `add_rms_norm`, `decode_block`, `decode_layers`). Every op writes
into an out-parameter (or works in place); the NumPy twins are `NumpyBackend` (numpy_backend.py).
"""
from __future__ import annotations

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from edgellm.backend import QMatrix, RingKV, attention_layout, qkv_attention_by_ops
from edgellm.kernels.cpu.jit import KERNEL_THREAD, STATE
from edgellm.kernels.cpu.tensor_types import FUSED_TYPES
from edgellm.kernels.cpu.numpy_backend import NumpyBackend, gelu_f16_table

F32 = np.float32


class CPUBackend(NumpyBackend):
    """The CPU backend: the NumpyBackend ops as Numba kernels (kernels/cpu/ops.py), and the fused
    ops as fewer kernel calls (`linear_many`, `qkv_attention`, `add_rms_norm`; `decode_block`: a
    whole block for one token in one call), so a decode step of a layer is one kernel call instead
    of ~20 NumPy ones."""

    def __init__(self, threads: int | None = None, resident: bool = False, flash_attn: bool = False):
        super().__init__(threads, flash_attn)
        from edgellm.resident import WeightArena

        # resident: weight matrices copied into huge-page memory (edgellm/resident.py), else mapped
        self.arena = WeightArena() if resident else None
        self._ops = None
        self._bound: dict[int, tuple] = {}  # id(QMatrix) -> (the QMatrix, kernels' bound Matrix)
        self._fused: dict[int, object] = {}  # id(block weights) -> decode_block's arguments, or False
        self._stacks: dict[tuple, object] = {}  # (blocks, caches, ropes) -> decode_layers' arguments, or False
        self._fused_ops = None
        self._act_buffers = None
        self._experts: dict[int, tuple] = {}  # id(a list of expert QMatrix) -> (the list, their packed rows)
        self.compiler = None  # warmup.CompilerRelease, from the first prepare

    def run(self, fn, *args):
        """fn(*args) on the process's kernel thread (jit.KERNEL_THREAD), with this backend's thread
        count (Numba keeps one per thread)."""
        return KERNEL_THREAD.call(self._with_threads, fn, args)

    def _with_threads(self, fn, args):
        if self.threads:
            import numba

            if numba.get_num_threads() != self.threads:
                self.kernels.set_threads(self.threads)
        return fn(*args)

    def make_resident(self, model) -> None:
        """With an arena: the matrices of the model's layers on this backend, and its output head
        when it runs here, copied into it (after the warm-up, so the compiler's pages are
        gone before the weights' arrive). The embedding table stays mapped (a row read a token)
        unless it is also the head. A mapped Q4_K matrix is not copied but packed by eight into the
        arena (by _matrix: at its first product for the warm-up's layers, here for the rest) and
        stays bound; other bindings are made again on first use."""
        if self.arena is None:
            return
        # the warm-up's layers' Q4_K matrices are packed into the arena already (_matrix)
        packed = {k: v for k, v in self._bound.items() if v[1].packed is not None}
        self._bound.clear()
        self._bound.update(packed)
        self._fused.clear()
        self._stacks.clear()
        experts = getattr(model, "expert_backends", model.layer_backends)
        for L, b, eb in zip(model.blocks, model.layer_backends, experts):
            for name, w in list(vars(L).items()):
                if isinstance(w, QMatrix) and b is self:
                    setattr(L, name, self._resident(w))
                elif isinstance(w, list) and eb is self and id(w) not in self._experts:  # a mixture of
                    # experts' matrices (bind_experts' lists are in one array already), in place
                    w[:] = [self._resident(e) if isinstance(e, QMatrix) else e for e in w]
        if model.output_backend is self and isinstance(model.output, QMatrix):
            if not self._packed(model.output):
                head = dataclasses.replace(model.output, data=self.arena.copy(model.output.data))
                if model.output is model.token_embd:
                    model.token_embd = head
                model.output = head

    def bind_experts(self, ws: list) -> None:
        """The experts of one mixture-of-experts tensor in one array (expert e's rows from row
        e * n_rows on; in the arena when there is one): Q4_K packed by eight, each expert bound to its
        part; Q6_K copied, the list's matrices replaced by views of it. What moe_decode's kernels
        read. Other types are bound one by one, later."""
        kernels = self.kernels
        w0 = ws[0] if ws else None
        if (w0 is None or not all(isinstance(w, QMatrix) for w in ws)
                or any((w.ggml_type, w.n_rows, w.n_cols) != (w0.ggml_type, w0.n_rows, w0.n_cols) for w in ws)):
            return
        from edgellm.kernels.cpu.kquants import pack8_shape
        from edgellm.resident import drop_pages
        from edgellm.validate import check_matrix_bytes

        if w0.ggml_type == GGMLType.Q6_K:  # rows copied end to end: the expert list's matrices become views
            for w in ws:
                check_matrix_bytes(w)
            rows, cols = w0.data.shape
            whole = self.arena.empty((len(ws) * rows, cols)) if self.arena is not None else \
                np.empty((len(ws) * rows, cols), np.uint8)
            for e, w in enumerate(ws):
                whole[e * rows:(e + 1) * rows] = w.data
                if not w.data.flags.writeable:
                    drop_pages(w.data)
            ws[:] = [dataclasses.replace(w, data=whole[e * rows:(e + 1) * rows]) for e, w in enumerate(ws)]
            self._experts[id(ws)] = (ws, whole)
            return
        if not kernels.packs_by_eight(w0.ggml_type, w0.n_rows):
            return

        rows, cols = pack8_shape(w0.data.shape)
        shape = (len(ws) * rows, cols)
        packed = self.arena.empty(shape) if self.arena is not None else np.empty(shape, np.uint8)
        for e, w in enumerate(ws):
            check_matrix_bytes(w)
            m = kernels.bind(w.ggml_type, w.data, w.n_cols)
            m.pack(lambda _shape, e=e: packed[e * rows:(e + 1) * rows])
            if not w.data.flags.writeable:
                drop_pages(w.data)
            self._bound[id(w)] = (w, m)
        self._experts[id(ws)] = (ws, packed)

    def moe_decode(self, experts, ids: np.ndarray, h: np.ndarray, out: np.ndarray) -> bool:
        """out (k, n_embd) = the SwiGLU FFN of the token h (1, n_embd) through expert ids[j] in row j,
        experts = (gate, up, down) lists: one conversion of h, the gate and up rows of every chosen
        expert in one parallel loop, the activation, the down rows in another (or expert by expert
        when the down experts are of another type); each row in the one-token order. False (nothing
        done) unless gate and up were packed by bind_experts."""
        found = [self._experts.get(id(ws)) for ws in experts]
        found = [f if f is not None and f[0] is ws else None for f, ws in zip(found, experts)]
        if found[0] is None or found[1] is None:
            return False
        (gl, gp), (_, upk) = found[:2]
        ff, k = gl[0].n_rows, ids.shape[0]
        moe = self.kernels._import("moe")
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        xq, xd, xs, _ = self.kernels.quantize("q8_k", h[0]).parts
        gate, up = np.empty((k, ff), F32), np.empty((k, ff), F32)
        moe.decode_gate_up_q4k8(gp, upk, ids, xq, xd, xs, xd.size, ff, gate.reshape(-1), up.reshape(-1))
        self.silu_mul(gate, up, gate)
        if found[2] is None:
            for j, e in enumerate(ids.tolist()):
                self.linear(experts[2][e], gate[j:j + 1], out[j:j + 1])
            return True
        dl, dp = found[2]
        xa = self.kernels._quantize("q8_k", gate.reshape(-1), batch=True)
        down = moe.decode_down_q6k if dl[0].ggml_type == GGMLType.Q6_K else moe.decode_down_q4k8
        down(dp, ids, xa.parts[0], xa.parts[1], xa.parts[2], ff // 256, dl[0].n_rows, out.reshape(-1))
        return True

    def _resident(self, w: QMatrix) -> QMatrix:
        """w in the arena: packed there (bound), or its rows copied."""
        return w if self._packed(w) else dataclasses.replace(w, data=self.arena.copy(w.data))

    def packed_extra_bytes(self) -> int:
        """Bytes the bound matrices packed by eight (Matrix.pack) hold beyond their file rows."""
        return sum(m.packed.nbytes - m.raw.nbytes for _, m in self._bound.values() if m.packed is not None)

    def _packed(self, w: QMatrix) -> bool:
        """w bound (_matrix, which packs a mapped Q4_K matrix with rows by eight into the arena):
        True when its products read a packed copy, so it need not be copied as it is."""
        return (self.kernels.packs_by_eight(w.ggml_type, w.n_rows) and not w.data.flags.writeable
                and self._matrix(w).packed is not None)

    def _matrix(self, w: QMatrix):
        """w bound to its kernels once (checks and kernel lookup paid at the first product): its
        bytes must be exactly n_rows rows of n_cols weights; each product then checks the widths
        of x and out against the bound matrix (kernels/cpu Matrix), decode_block against the
        block's activations (validate.check_fused_block)."""
        entry = self._bound.get(id(w))
        if entry is None:
            from edgellm.validate import check_matrix_bytes

            check_matrix_bytes(w)
            m = self.kernels.bind(w.ggml_type, w.data, w.n_cols)
            # Q4_K rows packed by eight (Matrix.pack) when the weights are a read-only file
            # mapping: the mapping's pages are dropped after, so the copy replaces them in memory
            # (with an arena the copy is made there: the warm-up's layers here, so it runs the
            # packed kernels, the rest in make_resident); writable in-memory weights stay as they
            # are (no second copy)
            if not w.data.flags.writeable and m.pack(None if self.arena is None else self.arena.empty):
                from edgellm.resident import drop_pages

                drop_pages(w.data)
            entry = self._bound[id(w)] = (w, m)
        return entry[1]

    def linear(self, w: QMatrix, x: np.ndarray, out: np.ndarray) -> None:
        m = self._matrix(w)
        if x.shape[0] == 1:
            m.matvec(x[0], out[0])
        else:
            m.matmul(x, out)

    def linear_many(self, ws, x: np.ndarray, outs) -> None:
        """outs[i] = x @ ws[i].T for matrices sharing their input (q/k/v, gate/up): one token's x
        is converted to each activation format once."""
        if x.shape[0] == 1 and all(isinstance(w, QMatrix) for w in ws):
            self.kernels.matvec_many([self._matrix(w) for w in ws], x[0], [o[0] for o in outs])
        elif x.shape[0] > 1 and all(isinstance(w, QMatrix) for w in ws):
            converted = {}  # a batch is converted once per activation format
            for w, out in zip(ws, outs):
                m = self._matrix(w)
                xa = converted.get(m.act_format)
                if xa is None:
                    xa = converted[m.act_format] = m.quantize_batch(x)
                if not m.matmul_act(xa, out):
                    m.matmul(x, out)
        else:  # subclasses with weights of their own (the reference backend)
            for w, out in zip(ws, outs):
                self.linear(w, x, out)

    def linear_rows(self, ws, x: np.ndarray, outs) -> None:
        """Backend.linear_rows: the batch converted once per activation format (row by row, as
        one token is), then each row through the one-token kernels."""
        if x.shape[0] == 1 or not all(isinstance(w, QMatrix) for w in ws):
            super().linear_rows(ws, x, outs)
            return
        converted = {}
        for w, out in zip(ws, outs):
            m = self._matrix(w)
            xa = converted.get(m.act_format)
            if xa is None:
                xa = converted[m.act_format] = m.quantize_batch(x)
            m.matvec_rows(xa, out)

    @property
    def ops(self):
        if self._ops is None:
            self.kernels  # the package's entry points, bound once
            from edgellm.kernels.cpu import ops

            self._ops = ops
        return self._ops

    def prepare(self, model, cfg, layer_devices, output_device: str, n_seq: int, kv_dtype, *,
                on_compile=None) -> None:
        """Load (or compile) the kernels this model's steps run (kernels.cpu.warmup), then hand the
        compiler's memory back. The CPU backend warms the layers placed on "cpu"."""
        from edgellm.kernels.cpu import warmup

        if self.device != "cpu":
            return
        warmup.warm_up(self, model, cfg, layer_devices, output_device, n_seq, kv_dtype, on_compile)
        if self.compiler is None:
            self.compiler = warmup.CompilerRelease(self.kernels)
        self.compiler.fused_pending = not STATE.fused_ready
        self.compiler.release()

    def after_step(self, shape: tuple) -> None:
        if self.compiler is not None:
            self.compiler.after_step(shape)

    @property
    def attn_kernels(self):
        """kernels/cpu/attention.py (ggml's order, flash attention off)."""
        self.ops  # (common.py, imported by ops, points Numba at the kernel cache dir)
        from edgellm.kernels.cpu import attention

        return attention

    @property
    def flash_kernels(self):
        """kernels/cpu/flash.py (flash attention)."""
        self.ops  # (as in attn_kernels)
        from edgellm.kernels.cpu import flash

        return flash

    @property
    def f16c(self) -> bool:
        """Half floats converted in hardware: the kernels read an f16 KV cache (else the twins)."""
        from edgellm.kernels.cpu.host import F16C

        return F16C

    def add(self, x: np.ndarray, y: np.ndarray, out: np.ndarray) -> None:
        np.add(x, y, out=out)  # one vectorized NumPy call; nothing to gain in Numba

    def rms_norm(self, x, w, eps, out) -> None:
        n = x.shape[-1]
        self.ops.rms_norm(x.reshape(-1, n), _NONE if w is None else w, F32(eps), out.reshape(-1, n))

    def add_rms_norm(self, x, o, post_w, next_w, eps, h) -> None:
        """Residual step: o = rms_norm(o) * post_w (if given); x += o; h = rms_norm(x) * next_w
        (if given). x, o, h (n_tok, n_embd)."""
        self.ops.add_rms_norm(x, o, _NONE if post_w is None else post_w, _NONE if next_w is None else next_w,
                              F32(eps), x if h is None else h)

    def rope(self, x, pos, n_rot, freq_base, freq_scale, neox) -> None:
        cos, sin = self.rope_tables.get(n_rot, freq_base, freq_scale, int(pos.max()) + 1)
        self.ops.rope(x, cos, sin, pos, n_rot, neox)

    def silu_mul(self, gate, up, out) -> None:
        n = gate.shape[-1]
        self.ops.silu_mul(gate.reshape(-1, n), up.reshape(-1, n), out.reshape(-1, n))

    def gelu_mul(self, gate, up, out) -> None:
        n = gate.shape[-1]
        self.ops.gelu_mul(gate.reshape(-1, n), up.reshape(-1, n), gelu_f16_table(), out.reshape(-1, n))

    def attention(self, q, kv, pos, scale, out) -> None:
        self._check_softcap(kv)
        if getattr(kv, "quant", None) is not None:
            return self._attention_flash_quant(q, kv, pos, scale, out)
        kc, vc = kv.kernel_arrays()
        if kc.dtype == np.uint16 and not self.f16c:
            return super().attention(q, kv, pos, scale, out)
        if self.flash_attn:
            return self._attention_flash_f16(q, kv, pos, scale, out)
        kmap, kbeg, kend, n_single, chunks = attention_layout(kv, q.shape[0])
        z = kc.dtype.type(0)
        scale = F32(scale)
        # ggml's order: vec_dot_f16's four accumulators for a token alone, tinyBLAS's one for a batch
        if n_single:
            self.attn_kernels.attend_ggml_decode(q[:n_single], kc, vc, kv.pos, kmap, kbeg[:n_single],
                                                 kend[:n_single], pos[:n_single], kv.window, scale, out[:n_single],
                                                 z, self.attn_softcap)
        for t0, t1 in chunks:
            keys = kmap[kbeg[t0]:kend[t0]]
            used = len(keys)
            if used and keys[-1] - keys[0] == used - 1 and (np.diff(keys) == 1).all():  # contiguous: views
                kk, vv, kp = kc[keys[0]:keys[0] + used], vc[keys[0]:keys[0] + used], kv.pos[keys[0]:keys[0] + used]
            else:
                kk, vv, kp = kc[keys], vc[keys], kv.pos[keys]
            # V transposed (keys contiguous per element, as ggml stores it), zero-padded to a
            # multiple of 8 keys
            vt = np.zeros((vv.shape[1], vv.shape[2], -(-used // 8) * 8), vv.dtype)
            vt[:, :, :used] = vv.transpose(1, 2, 0)
            self.attn_kernels.attend_batch(q[t0:t1], kk, vt, kp, used, pos[t0:t1], kv.window, scale, out[t0:t1],
                                           z, self.attn_softcap)

    def _attention_flash_quant(self, q, kv, pos, scale, out) -> None:
        """A q8_0 / q4_0 cache as llama.cpp reads one: its CPU flash attention, in its order
        (flash.attend_flash_quant; the queries as Q8_0 blocks, the keys' integer block dot products,
        an online softmax, the values dequantized row by row)."""
        from edgellm.kernels import cpu

        kmap, kbeg, kend, _, _ = attention_layout(kv, q.shape[0])
        n_tok, n_head, hd = q.shape
        xq, xd = cpu.quantize("q8_32", np.ascontiguousarray(q, F32).reshape(-1)).parts[:2]
        q4 = kv.quant.ggml_type == GGMLType.Q4_0
        self.flash_kernels.attend_flash_quant(xq.reshape(n_tok, n_head, hd), xd.reshape(n_tok, n_head, hd // 32),
                                              kv.k, kv.v, q4, q4, kv.pos, kmap, kbeg, kend, np.asarray(pos, np.int64),
                                              kv.window, F32(scale), out)

    def _attention_flash_f16(self, q, kv, pos, scale, out) -> None:
        """An f16 cache as llama.cpp reads one with flash attention on (flash.attend_flash_f16)."""
        flash = self.flash_kernels
        kmap, kbeg, kend, kinds, cells = self._flash_f16_steps(kv, q.shape[0])
        codes = {"one_chunk": flash.FA_ONE_CHUNK, "tiled": flash.FA_TILED, "split": flash.FA_SPLIT}
        kc, vc = kv.kernel_arrays()
        q = np.ascontiguousarray(q, F32)
        kmap, pos = np.asarray(kmap, np.int64), np.asarray(pos, np.int64)
        kernel = np.array([codes[k] for k in kinds], np.int64)
        if (kernel != flash.FA_TILED).any():
            flash.attend_flash_f16(q, kc, vc, kv.pos, kmap, np.asarray(kbeg, np.int64), np.asarray(kend, np.int64),
                                   pos, kv.window, F32(scale), kernel, cells, self.flash_splits(), out)
        t = 0
        while t < len(kinds):  # a tiled chunk: consecutive rows of one sequence sharing their keys
            t1 = t + 1
            if kinds[t] == "tiled":
                while t1 < len(kinds) and kinds[t1] == "tiled" and kbeg[t1] == kbeg[t] and kend[t1] == kend[t]:
                    t1 += 1
                flash.attend_flash_f16_tiled(q[t:t1], kc, vc, kv.pos, kmap, int(kbeg[t]), int(kend[t]), pos[t:t1],
                                             kv.window, F32(scale), out[t:t1])
            t = t1

    def decode_block(self, L, x, pos, kv, s, *, eps, n_rot, freq_base, freq_scale, neox, scale, gelu,
                     q_scale=1.0) -> bool:
        """n decode tokens, each of its own sequence (the step layout's single tokens), through
        block L (weights as Decoder loads them) in one kernel call (kernels/cpu/fused.py), x
        (n, n_embd) updated in place, s the decoder's scratch for n rows. Each token gets the bits
        it gets through the block alone. Returns False, having done nothing, when the block needs
        the unfused ops: a weight type without a row kernel there, or a cache the kernels cannot
        read natively."""
        return self.decode_layers([L], x, pos, [kv], s, ropes=[(freq_base, freq_scale)], eps=eps, n_rot=n_rot,
                                  neox=neox, scale=scale, gelu=gelu, q_scale=q_scale)

    def decode_layers(self, blocks, x, pos, kvs, s, *, ropes, eps, n_rot, neox, scale, gelu, q_scale=1.0) -> bool:
        """decode_block for several blocks in order (a whole model's layers) in one kernel call:
        blocks[i] with cache kvs[i] and RoPE (freq_base, freq_scale) ropes[i]. The same bits as the
        blocks one by one; False, having done nothing, when one of them needs the unfused ops (or
        the fused kernel is still being compiled: jit.STATE.fused_ready)."""
        if not STATE.fused_ready or self.flash_attn:  # (the fused kernel reads the cache without it)
            return False
        key = (tuple(map(id, blocks)), tuple(map(id, kvs)), tuple(ropes))
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stack_plan(blocks, kvs, ropes)
            if len(self._stacks) >= 32:  # plans of scratch caches the warm-up has let go of
                self._stacks.clear()
            self._stacks[key] = stack
        n = x.shape[0]
        if stack is False or n > stack.max_tokens:
            return False
        seen = stack.checked.get(id(s))
        if seen is None or seen[0] is not s or seen[1] != x.shape:
            from edgellm.validate import check_fused_block

            for L, kv in zip(blocks, kvs):
                check_fused_block(L, x, s, *kv.kernel_arrays())
            if len(stack.checked) >= 8:  # scratch sets the decoder has let go of
                stack.checked.clear()
            stack.checked[id(s)] = (s, x.shape)
        # the step's layout per group of layers sharing a cache layout
        if len(stack.groups) == 1:
            kv = stack.groups[0]
            slots = kv.slots(pos)
            if isinstance(kv, RingKV):
                kv.n_used = max(kv.n_used, int(slots.max()) + 1)
            kmap, kbeg, kend, _, _ = attention_layout(kv, n)
            slots, kbeg, kend = (np.ascontiguousarray(a, np.int64).reshape(1, n) for a in (slots, kbeg, kend))
        else:
            parts = []
            off = 0
            for kv in stack.groups:
                sl = kv.slots(pos)
                if isinstance(kv, RingKV):
                    kv.n_used = max(kv.n_used, int(sl.max()) + 1)
                km, kb, ke, _, _ = attention_layout(kv, n)
                parts.append((sl, km, kb + off, ke + off))
                off += len(km)
            slots = np.stack([p[0] for p in parts]).astype(np.int64, copy=False)
            kmap = np.concatenate([p[1] for p in parts]).astype(np.int64, copy=False)
            kbeg = np.stack([p[2] for p in parts]).astype(np.int64, copy=False)
            kend = np.stack([p[3] for p in parts]).astype(np.int64, copy=False)
        n_pos = int(pos.max()) + 1
        rope = np.empty((len(stack.ropes), 4), np.int64)
        for i, (base, fscale) in enumerate(stack.ropes):  # (the tables stay alive in self.rope_tables)
            cos, sin = self.rope_tables.get(n_rot, base, fscale, n_pos)
            rope[i] = (cos.ctypes.data, sin.ctypes.data, cos.shape[0], cos.shape[1])
        kc0 = stack.kv_arrays[0][0]
        n_head, n_kv = s.q.shape[1] // kc0.shape[2], kc0.shape[1]
        import numba  # (as in run: numba loads with the kernels, not with this module)

        self.fused_ops.decode_layers(
            x, s.h[:n], s.q[:n].reshape(n, n_head, -1), s.k[:n].reshape(n, n_kv, -1), s.v[:n].reshape(n, n_kv, -1),
            s.a[:n], s.o[:n], s.gate[:n], s.up[:n],
            *self._fused_activations(n * max(x.shape[1], s.gate.shape[1], s.a.shape[1])), stack.table, stack.mask,
            F32(eps), rope, pos, n_rot, neox, slots, kmap, kbeg, kend, F32(scale), gelu, gelu_f16_table(), F32(q_scale),
            numba.get_num_threads())
        return True

    def _stack_plan(self, blocks, kvs, ropes):
        """decode_layers' fixed arguments for these blocks and caches: the layer table (addresses
        and sizes of every weight, norm and cache; fused.T_COLS), the mask and token limit of all
        their types, the cache groups (one KV layer standing for each distinct slot-position
        array) and the RoPE settings; the arrays are kept here so the addresses stay valid. False
        when a block needs the unfused ops."""
        from types import SimpleNamespace

        fused = self.fused_ops
        plans = []
        for L, kv in zip(blocks, kvs):
            plan = self._fused.get(id(L))
            if plan is None:
                plan = self._fused[id(L)] = self._fused_plan(L, kv)
            if plan is False or not self._fused_cache_ok(kv):
                return False
            plans.append(plan)
        groups, group_of = [], {}
        rope_keys = list(dict.fromkeys(ropes))
        table = np.zeros((len(blocks), fused.T_COLS), np.int64)
        keep = []
        for il, (plan, kv, rp) in enumerate(zip(plans, kvs, ropes)):
            weights, norms, tids, _, _, _ = plan
            row = table[il]
            for j, a in enumerate(norms):
                if a.dtype != F32 or a.ndim != 1 or not a.flags.c_contiguous:
                    return False
                row[fused.T_NORMS + 2 * j:fused.T_NORMS + 2 * j + 2] = (a.ctypes.data, a.shape[0])
            for j, w in enumerate(weights):
                if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
                    return False
                row[fused.T_W + 3 * j:fused.T_W + 3 * j + 3] = (w.ctypes.data, w.shape[0], w.shape[1])
            row[fused.T_TIDS:fused.T_TIDS + 7] = tids
            kc, vc = kv.kernel_arrays()
            row[fused.T_KC:fused.T_KC + 4] = (kc.ctypes.data, *kc.shape)
            row[fused.T_VC:fused.T_VC + 4] = (vc.ctypes.data, *vc.shape)
            kpos = kv.pos
            row[fused.T_KPOS:fused.T_KPOS + 2] = (kpos.ctypes.data, kpos.shape[0])
            g = group_of.get(id(kpos))
            if g is None:
                g = group_of[id(kpos)] = len(groups)
                groups.append(kv)
            row[fused.T_WINDOW], row[fused.T_GROUP], row[fused.T_ROPE] = kv.window, g, rope_keys.index(rp)
            keep.append((weights, norms, kc, vc, kpos))
        types = {int(t) for p in plans for t in p[2]}
        return SimpleNamespace(table=table, mask=fused.type_mask(types), max_tokens=min(p[5] for p in plans),
                               groups=groups, ropes=rope_keys, kv_arrays=[k[2:4] for k in keep],
                               keep=(keep, list(blocks), list(kvs)), checked={})  # kvs: their ids stay theirs

    @staticmethod
    def _fused_cache_ok(kv) -> bool:
        kc, vc = kv.kernel_arrays()
        return (kc.dtype == np.uint16 and vc.dtype == np.uint16 and kc.ndim == 3 and vc.ndim == 3
                and kc.flags.c_contiguous and vc.flags.c_contiguous and kv.pos.dtype == np.int64
                and kv.pos.flags.c_contiguous and kc.shape[0] == vc.shape[0] == kv.pos.shape[0])

    def _fused_plan(self, L, kv):
        names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
        mats = [getattr(L, n) for n in names]
        kc, vc = kv.kernel_arrays()
        fused = self.fused_ops
        if not (self.f16c and kc.dtype == np.uint16 and kc.shape[2] % 8 == 0 and vc.shape[2] % 8 == 0
                and all(isinstance(m, QMatrix) and m.ggml_type in FUSED_TYPES for m in mats)):
            return False
        bound = [self._matrix(m) for m in mats]
        weights = tuple(b.weights for b in bound)
        norms = tuple(_NONE if a is None else a for a in (
            L.attn_norm, L.post_attention_norm, L.ffn_norm, L.post_ffw_norm, L.attn_q_norm, L.attn_k_norm,
            L.attn_q_bias, L.attn_k_bias, L.attn_v_bias))
        tids = np.array([fused.Q4_K8 if b.packed is not None else m.ggml_type for m, b in zip(mats, bound)],
                        dtype=np.int64)
        types = {int(t) for t in tids}
        return weights, norms, tids, {}, fused.type_mask(types), fused.max_tokens(types)

    def _fused_activations(self, n: int):
        """(q8_32 parts, q8_k parts) buffers for inputs of up to n values, kept per backend."""
        n = -(-n // 256) * 256
        if self._act_buffers is None or self._act_buffers[0][0].size < n:
            self._act_buffers = (
                (np.empty(n, np.int8), np.empty(n // 32, F32), np.empty(n // 32, np.int32), np.empty(n // 32, F32)),
                (np.empty(n, np.int8), np.empty(n // 256, F32), np.empty(n // 16, np.int32), np.empty(0, F32)))
        return self._act_buffers

    @property
    def fused_ops(self):
        if self._fused_ops is None:
            self.ops
            from edgellm.kernels.cpu import fused

            self._fused_ops = fused
        return self._fused_ops

    def qkv_attention(self, q, k, v, *, biases, q_norm, k_norm, eps, n_rot, freq_base, freq_scale, neox,
                      kv, pos, scale, out, q_scale=1.0) -> None:
        """Everything from the q, k, v projections to the attention output in two kernel calls:
        + biases, QK-norm, RoPE, q * q_scale, k and v into the cache (one call), attention (one call).
        q (n_tok, n_head, hd_k), k (n_tok, n_kv, hd_k), v (n_tok, n_kv, hd_v), all changed in place;
        biases (bq, bk, bv) and the norms may be None; out (n_tok, n_head * hd_v)."""
        kc, vc = kv.kernel_arrays()
        if (kc.dtype == np.uint16 and not self.f16c) or getattr(kv, "quant", None) is not None:
            return qkv_attention_by_ops(self, q, k, v, biases, q_norm, k_norm, eps, n_rot, freq_base,
                                         freq_scale, neox, kv, pos, scale, out, q_scale)
        cos, sin = self.rope_tables.get(n_rot, freq_base, freq_scale, int(pos.max()) + 1)
        bq, bk, bv = (_NONE if b is None else b for b in biases)
        slots = kv.slots(pos)
        self.ops.prepare_qkv(q, k, v, bq, bk, bv, _NONE if q_norm is None else q_norm,
                             _NONE if k_norm is None else k_norm, F32(eps), cos, sin, pos, n_rot, neox,
                             kc, vc, kv.pos, slots, F32(q_scale))
        if isinstance(kv, RingKV):
            kv.n_used = max(kv.n_used, int(slots.max()) + 1)
        self.attention(q, kv, pos, scale, out)


_NONE = np.empty(0, dtype=F32)  # "no weight" / "no bias" for the kernels (read-only use)
