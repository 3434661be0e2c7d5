"""The memory ledger and the layer -> device plan. Pure: reads no tensor data, imports no CuPy.

Per device, memory is five terms (design.md, "The memory ledger"):

    weights      exact bytes of the tensors placed there (TensorInfo.nbytes)
    kv_cache     per layer: the slots of its group's block pool x (head_dim_k + head_dim_v) * n_head_kv
                 * bytes(kv_type) (edgellm/kv_cache.py: the same formula allocates the cache)
    activations  the buffers of one forward step of n_batch tokens, by name (`activation_buffers`)
    runtime      GPU: CUDA context + cuBLAS + allocator; CPU: interpreter, NumPy, Numba (constants below)
    margin       MARGIN_FRACTION of the first three, at least MARGIN_MIN, on a device that holds anything

Placement follows llama.cpp (src/llama-model.cpp, `i_gpu_start`): the token embedding stays on the CPU
(a lookup, not a matmul), the output head goes to the GPU first, then the LAST blocks. edgellm counts
`n_gpu_layers` in blocks: N >= 1 puts the output head and blocks n_layer-N .. n_layer-1 on the GPU
(llama.cpp counts the head as one more layer, so its -ngl N+1 is edgellm's N). When the output is tied
to token_embd and goes to the GPU, the GPU holds its own copy of that matrix.

Sliding-window layers: llama.cpp keeps n_ctx cells for them too unless swa_full is off; edgellm's KV
pool for the sliding layers holds per sequence the window plus a batch (and a block each side), and
the planner charges exactly the pool's blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from edgellm.errors import InvalidArgumentError, PlanError
from edgellm.kv_cache import BLOCK_SIZE, KV_TYPES, blocks_per_sequence, kv_bytes_per_token, layer_window, pool_blocks
from edgellm.memory import MiB, Budgets, format_size


# The GPU backend's prompt products dequantize at most this many bytes of a matrix at a time
# (kernels/cuda/backend.py DEQUANT_BUFFER_BYTES; the planner imports no CuPy code).
GPU_DEQUANT_BYTES = 32 << 20
# GPU runtime: the CUDA context (~300-450 MiB of device memory on a current driver with lazy module
# loading, more on GPUs with many SMs), the cuBLAS handle and workspace (~32-64 MiB) and the rounding
# of CuPy's memory pool. 512 MiB covers that range; it is charged only when the GPU holds a layer.
# Not yet measured on this project's GPU machine: scripts/gpu_check.sh is where to measure it.
GPU_RUNTIME_BYTES = 512 * MiB
# CPU runtime, measured: RSS of a fresh `python -c "import numpy, numba"` is 90-157 MiB, the
# difference being how many pages of the shared libraries (libllvmlite.so alone 36-95 MiB) the
# kernel maps for the process, which depends on the page cache (a fresh install: all of them).
# The ledger charges the libraries fully resident (CPU_LIBRARY_BYTES: sum of the RSS of the .so
# mappings after a whole-model run in a fresh venv, 136 MiB) plus the interpreter's own memory
# beyond them (whole-model peak RSS minus every other term, 57 MiB for SmolLM2 and for Gemma-3).
CPU_LIBRARY_BYTES = 136 * MiB
CPU_RUNTIME_BYTES = 57 * MiB + CPU_LIBRARY_BYTES
# The vocabulary (metadata string arrays as bytes + offsets, sorted-hash indexes of tokens and BPE
# merges, scores, types), measured as RSS growth over opening the file and building the tokenizer:
# SmolLM2 (49,152 tokens, 48,900 merges) 9.2 MiB, Gemma-3 (262,144 tokens) 20.0 MiB.
TOKENIZER_BYTES_PER_TOKEN = 80
TOKENIZER_BYTES_PER_MERGE = 117
# Host memory the CUDA driver and CuPy take when a GPU is used (pinned staging, driver mappings). An
# estimate, like GPU_RUNTIME_BYTES, to be measured next to it.
CUDA_HOST_RUNTIME_BYTES = 256 * MiB
MARGIN_FRACTION = 0.05  # allocator fragmentation, buffers the model forgot to name
MARGIN_MIN = 64 * MiB

F32 = 4  # bytes of every activation element
ATTN_THREADS = 64  # threads whose attention scratch is charged (more than any CPU here has)
Q8_BLOCK = (32, 2 + 32)  # activations quantized to Q8_0 for the integer dot products: 32 values per 34 B


# ============================================================================ inputs
@dataclass(frozen=True)
class WeightSizes:
    """Exact tensor bytes grouped the way the planner places them."""

    blocks: tuple[int, ...]  # bytes of blk.N.* per block
    token_embd: int  # stays on the CPU
    head: int  # output.weight, or token_embd when tied (the GPU then holds its own copy)
    output_norm: int
    tied_output: bool
    n_params: int  # elements of all tensors, for bits per weight
    other: int = 0  # any other tensor (e.g. llama 3's rope_freqs), kept on the CPU
    # bytes a block / the head takes on the CPU beyond its file size: Q4_K matrices with a multiple
    # of 8 rows are packed by eight there (kernels/cpu Matrix.pack), 37 bytes for every 36
    cpu_extra: tuple[int, ...] = ()
    head_cpu_extra: int = 0
    # a mixture-of-experts block's parts placed apart (included in blocks / cpu_extra): the expert
    # tensors (--cpu-moe, -ot), their CPU packing, and the router, which runs on the host
    experts: tuple[int, ...] = ()
    experts_cpu_extra: tuple[int, ...] = ()
    routers: tuple[int, ...] = ()

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Any], n_layer: int) -> "WeightSizes":
        """From a GGUFFile's tensor table (name -> TensorInfo with .nbytes and .n_elements)."""
        blocks, other, extra = [0] * n_layer, 0, [0] * n_layer
        experts, experts_extra, routers = [0] * n_layer, [0] * n_layer, [0] * n_layer
        for name, t in tensors.items():
            parts = name.split(".")
            if parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < n_layer:
                il = int(parts[1])
                blocks[il] += t.nbytes
                extra[il] += cpu_packed_extra(t)
                if parts[2] in EXPERT_TENSORS:
                    experts[il] += t.nbytes
                    experts_extra[il] += cpu_packed_extra(t)
                elif parts[2] == "ffn_gate_inp":
                    routers[il] += t.nbytes
            elif name not in ("token_embd.weight", "output.weight", "output_norm.weight"):
                other += t.nbytes
        tied = "output.weight" not in tensors
        head = tensors["token_embd.weight" if tied else "output.weight"].nbytes
        return cls(
            blocks=tuple(blocks),
            token_embd=tensors["token_embd.weight"].nbytes,
            head=head,
            output_norm=tensors["output_norm.weight"].nbytes if "output_norm.weight" in tensors else 0,
            tied_output=tied,
            n_params=sum(t.n_elements for t in tensors.values()),
            other=other,
            cpu_extra=tuple(extra),
            head_cpu_extra=cpu_packed_extra(tensors["token_embd.weight" if tied else "output.weight"]),
            experts=tuple(experts) if any(experts) else (),
            experts_cpu_extra=tuple(experts_extra) if any(experts) else (),
            routers=tuple(routers) if any(experts) else (),
        )

    @property
    def has_experts(self) -> bool:
        return bool(self.experts)

    @property
    def total(self) -> int:
        """Bytes of the file's tensors (a tied head counted once)."""
        head = 0 if self.tied_output else self.head
        return sum(self.blocks) + self.token_embd + self.output_norm + head + self.other

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.total / max(self.n_params, 1)

    def scaled(self, factor: float) -> "WeightSizes":
        """The same model at another quant type, estimated by scaling every tensor's bytes."""
        return replace(
            self,
            blocks=tuple(int(b * factor) for b in self.blocks),
            token_embd=int(self.token_embd * factor),
            head=int(self.head * factor),
            cpu_extra=(), head_cpu_extra=0,  # the packing is Q4_K's: not known for another type
            experts=tuple(int(b * factor) for b in self.experts), experts_cpu_extra=(),
        )


# a mixture-of-experts block's expert tensors (what --cpu-moe places on the CPU)
EXPERT_TENSORS = frozenset(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps"))


def cpu_packed_extra(t) -> int:
    """Bytes a tensor takes on the CPU beyond its file size: a Q4_K matrix with a multiple of 8 rows
    is packed by eight (37 / 36 of its bytes, the mapping's pages given back), others 0."""
    from edgellm.kernels.cpu import packs_by_eight

    qtype = getattr(t, "qtype", None)
    return t.nbytes // 36 if packs_by_eight(getattr(qtype, "ggml_type", None), getattr(t, "n_rows", 0)) else 0


@dataclass(frozen=True)
class RunShape:
    n_ctx: int
    n_batch: int
    n_seq: int
    kv_type: str
    kv_size: int | None = None  # KV pool in tokens (None: n_seq contexts)

    @property
    def n_tok(self) -> int:
        """Tokens in one forward step: a prompt batch, never more than the context."""
        return min(self.n_batch, self.n_ctx)


# ============================================================================ the four terms
def layer_n_ctx(config, il: int, shape: RunShape) -> int:
    """Longest key list of layer il: n_ctx, or a sliding window's blocks (window + a batch)."""
    w = layer_window(config, il)
    return shape.n_ctx if w == 0 else min(shape.n_ctx, blocks_per_sequence(w, shape.n_ctx, shape.n_batch) * BLOCK_SIZE)


def kv_cache_bytes(config, il: int, shape: RunShape) -> int:
    """K and V of one layer: its group's pool slots x bytes per token (kv_cache's formula)."""
    n = pool_blocks(layer_window(config, il), n_ctx=shape.n_ctx, n_batch=shape.n_batch, n_seq=shape.n_seq,
                    kv_size=shape.kv_size)
    return n * BLOCK_SIZE * kv_bytes_per_token(config, shape.kv_type)


def kv_pool_groups(config, shape: RunShape) -> tuple:
    """The KV pool per group of layers sharing a window: (window, layers, blocks, bytes)."""
    windows = [layer_window(config, il) for il in range(config.n_layer)]
    out = []
    for w in sorted(set(windows)):
        n_layers = windows.count(w)
        blocks = pool_blocks(w, n_ctx=shape.n_ctx, n_batch=shape.n_batch, n_seq=shape.n_seq, kv_size=shape.kv_size)
        out.append((w, n_layers, blocks, n_layers * blocks * BLOCK_SIZE * kv_bytes_per_token(config, shape.kv_type)))
    return tuple(out)


def activation_buffers(config, shape: RunShape, *, runs_blocks: bool, holds_head: bool, is_host: bool,
                       n_ctx_attn: int, runs_experts: bool | None = None, crosses: bool = False) -> dict[str, int]:
    """Named float32 buffers of one forward step of n_tok = min(n_batch, n_ctx) tokens, in bytes.

    A device that runs blocks allocates the per-layer scratch once and reuses it for every layer; the
    device with the output head holds the logits; the host always holds the embedded batch and the
    logits handed back to the caller. `n_ctx_attn` is the longest KV a block on this device attends to.
    runs_experts: the device runs mixture-of-experts FFNs (default: runs_blocks); crosses: some of
    them belong to a layer on the other device (the step's normed rows come in, their sum goes back).
    """
    if runs_experts is None:
        runs_experts = runs_blocks
    t, c = shape.n_tok, config
    kt = KV_TYPES[shape.kv_type]
    # bytes per K/V value of a sequence gathered from the paged cache for the GPU kernel: the cache's
    # own values, and for a block-quantized cache also their float32 dequantization (the kernel's input)
    gathered = kt.bytes_per_value + (F32 if kt.quantized else 0)
    q_dim, kv_dim_k, kv_dim_v = c.n_head * c.head_dim_k, c.n_head_kv * c.head_dim_k, c.n_head_kv * c.head_dim_v
    buffers: dict[str, int] = {}
    if is_host or runs_blocks or holds_head:
        buffers["hidden"] = t * c.n_embd * F32  # residual stream (n_tok, n_embd)
    if runs_blocks or holds_head:
        buffers["normed"] = t * c.n_embd * F32  # rms_norm output (n_tok, n_embd)
    if runs_blocks:
        from edgellm.models.decoder import ffn_chunks

        ffn_rows = max(m for _, m in ffn_chunks(t))
        widest = max(c.n_embd, c.n_ff, c.n_head * c.head_dim_v)
        buffers.update(
            q=t * q_dim * F32,  # (n_tok, n_head, head_dim_k)
            k=t * kv_dim_k * F32,  # (n_tok, n_head_kv, head_dim_k), before it is written to the cache
            v=t * kv_dim_v * F32,  # (n_tok, n_head_kv, head_dim_v)
            # attention: the CPU kernel holds one row of scores and 32 lanes of head_dim_v sums per
            # thread; on the GPU a sequence's keys and values are gathered from the paged cache
            # (n_ctx of them; a quantized cache's blocks and their float32 values) for the kernel,
            # which keeps its scores in shared memory
            attn_scores=(ATTN_THREADS * (n_ctx_attn + 32 * c.head_dim_v) * F32 if is_host
                         else int(n_ctx_attn * (kv_dim_k + kv_dim_v) * gathered)),
            attn_out=t * c.n_head * c.head_dim_v * F32,  # (n_tok, n_head * head_dim_v)
            proj_out=t * c.n_embd * F32,  # attn_output / ffn_down result before the residual add
            ffn_gate=ffn_rows * c.n_ff * F32,  # (FFN chunk, n_ff): a prompt's FFN runs in chunks
            ffn_up=ffn_rows * c.n_ff * F32,  # (FFN chunk, n_ff)
            x_q8=t * (widest // Q8_BLOCK[0] + 1) * Q8_BLOCK[1],  # matmul input quantized to Q8_0
        )
    moe = getattr(c, "extra", None) or {}
    if runs_experts and "n_expert" in moe:
        k, ffe = moe["n_expert_used"], moe["n_ff_exp"]
        if crosses:  # a GPU layer's FFN input and output, on the host
            buffers.update(moe_in=t * c.n_embd * F32, moe_sum=t * c.n_embd * F32)
        buffers.update(
            moe_logits=t * moe["n_expert"] * F32,  # the router's scores (n_tok, n_expert)
            moe_out=t * k * c.n_embd * F32,  # each chosen expert's output, weighted, before their sum
            # one expert at a time: its rows (at most every token), their gate, up and down products
            moe_rows=t * c.n_embd * F32, moe_gate=t * ffe * F32, moe_up=t * ffe * F32,
            moe_down=t * c.n_embd * F32,
        )
        if moe.get("n_ff_shexp") is not None:  # qwen2moe: the experts' sum kept while the shared expert runs
            ffs = moe["n_ff_shexp"] or c.n_ff
            buffers.update(shexp_sum=t * c.n_embd * F32, shexp_gate=ffn_rows * ffs * F32,
                           shexp_up=ffn_rows * ffs * F32)
    if not is_host and (runs_blocks or holds_head):
        # a prompt's product dequantizes its matrix to float32, at most GPU_DEQUANT_BYTES at a time
        # (a slice of rows of a larger one), and the slice's output (n_tok, rows of the slice)
        widest_matrix = max(c.n_ff, c.n_vocab if holds_head else 0, c.n_head * c.head_dim_k) * c.n_embd
        buffers["dequant"] = min(widest_matrix * F32, GPU_DEQUANT_BYTES)
        buffers["dequant_out"] = t * (buffers["dequant"] // (c.n_embd * F32)) * F32
    if holds_head or is_host:
        # (rows, n_vocab): a generation step needs the logits of one row per sequence (the last
        # token of each); Model.logits() of a whole batch allocates its own n_tok rows on top
        buffers["logits"] = min(t, shape.n_seq) * c.n_vocab * F32
    return buffers


# ============================================================================ ledger and plan
@dataclass(frozen=True)
class Ledger:
    device: str  # "cpu" | "gpu"
    weights: int
    kv_cache: int
    activations: int
    runtime: int
    margin: int
    budget: int
    budget_source: str = ""
    activation_buffers: tuple[tuple[str, int], ...] = ()
    draft: int = 0  # a draft model's weights, KV cache and activations here (speculative decoding)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations + self.runtime + self.margin + self.draft

    @property
    def fits(self) -> bool:
        return self.total <= self.budget

    def as_dict(self) -> dict[str, Any]:
        return {
            "weights": self.weights,
            "kv_cache": self.kv_cache,
            "activations": self.activations,
            "runtime": self.runtime,
            "margin": self.margin,
            "draft": self.draft,
            "total": self.total,
            "budget": self.budget,
            "budget_source": self.budget_source,
            "fits": self.fits,
            "activation_buffers": dict(self.activation_buffers),
        }


@dataclass(frozen=True)
class Plan:
    layers: tuple[str, ...]  # "cpu" | "gpu" per block
    output_device: str
    n_gpu_layers: int
    shape: RunShape
    cpu: Ledger
    gpu: Ledger
    notes: tuple[str, ...] = ()  # why the split is what it is
    remedies: tuple[str, ...] = field(default=(), compare=False)  # when it does not fit, in order
    kv_pool: tuple = field(default=(), compare=False)  # per layer group: (window, n_layers, blocks, bytes)
    # the device of each block's expert tensors (a mixture-of-experts model; () for a dense one)
    experts: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        return self.cpu.fits and self.gpu.fits

    @property
    def devices(self) -> dict[str, Ledger]:
        return {"cpu": self.cpu, "gpu": self.gpu}

    def layer_map(self) -> str:
        """"blocks 0-9 cpu, 10-29 gpu, output gpu"."""
        return (f"{_runs(self.layers)}, output {self.output_device}" if self.layers
                else f"output {self.output_device}")

    def expert_map(self) -> str:
        """"blocks 0-27 cpu, 28-47 gpu": where the experts are; "" for a dense model."""
        return _runs(self.experts) if self.experts else ""

    @property
    def split_layers(self) -> int:
        """Blocks whose experts sit on another device than the rest of the block."""
        return sum(e != d for e, d in zip(self.experts, self.layers))

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "n_gpu_layers": self.n_gpu_layers,
            "output_device": self.output_device,
            "layers": list(self.layers),
            "experts": list(self.experts),
            "n_ctx": self.shape.n_ctx,
            "n_batch": self.shape.n_batch,
            "n_seq": self.shape.n_seq,
            "kv_type": self.shape.kv_type,
            "kv_pool": {"block_size": BLOCK_SIZE,
                        "groups": [{"window": w, "layers": n, "blocks": b, "bytes": nb}
                                   for w, n, b, nb in self.kv_pool]},
            "devices": {name: ledger.as_dict() for name, ledger in self.devices.items()},
            "notes": list(self.notes),
            "remedies": list(self.remedies),
        }


def _runs(devices) -> str:
    """"blocks 0-9 cpu, 10-29 gpu"""
    runs, start = [], 0
    for il in range(1, len(devices) + 1):
        if il == len(devices) or devices[il] != devices[start]:
            span = f"{start}" if il - 1 == start else f"{start}-{il - 1}"
            runs.append(f"{span} {devices[start]}")
            start = il
    return f"blocks {', '.join(runs)}"


@dataclass(frozen=True)
class RuntimeCosts:
    """Runtime constants, overridable for tests and for a machine where they were measured."""

    gpu_runtime: int = GPU_RUNTIME_BYTES
    cpu_runtime: int = CPU_RUNTIME_BYTES
    cuda_host_runtime: int = CUDA_HOST_RUNTIME_BYTES
    # a draft model loaded beside this one: its weights, KV cache and activations per device (its
    # own plan's; the process's runtime is counted once)
    draft_cpu: int = 0
    draft_gpu: int = 0


def tokenizer_bytes(config) -> int:
    """Host memory of the tokenizer's tables for this vocabulary."""
    return (config.n_vocab * TOKENIZER_BYTES_PER_TOKEN
            + getattr(config, "n_merges", 0) * TOKENIZER_BYTES_PER_MERGE)


def _margin(used: int) -> int:
    return max(MARGIN_MIN, int(MARGIN_FRACTION * used)) if used else 0


def device_weights(sizes: WeightSizes, layers, output_device: str, cpu_bytes: int, head: int, experts=(),
                   expert_share: float = 1.0) -> dict[str, int]:
    """Weight bytes per device: cpu_bytes on the CPU, each block's bytes on its device (its experts'
    on experts[il], times expert_share: the part a token reads; its router on the CPU), the output
    norm and `head` on the output device."""
    out = {"cpu": cpu_bytes}
    for il, (dev, n) in enumerate(zip(layers, sizes.blocks)):
        if sizes.experts:
            e, r = sizes.experts[il], sizes.routers[il]
            edev = experts[il] if experts else dev
            out[dev] = out.get(dev, 0) + n - e - r
            out[edev] = out.get(edev, 0) + int(e * expert_share)
            out["cpu"] += r
        else:
            out[dev] = out.get(dev, 0) + n
    out[output_device] = out.get(output_device, 0) + sizes.output_norm + head
    return out


def layer_devices(n_layer: int, n_gpu: int) -> tuple[str, ...]:
    """The last n_gpu blocks on the GPU."""
    return tuple("gpu" if il >= n_layer - n_gpu else "cpu" for il in range(n_layer))


def expert_devices(layers, fixed: Mapping[int, str] = {}, n_cpu_moe: int = 0) -> tuple[str, ...]:
    """Each block's expert device: `fixed` (the overrides), else the CPU for the first n_cpu_moe
    blocks, else the block's own device."""
    return tuple(fixed.get(il, "cpu" if il < n_cpu_moe else d) for il, d in enumerate(layers))


def ledgers(config, sizes: WeightSizes, n_gpu: int, output_device: str, shape: RunShape, budgets: Budgets,
            costs: RuntimeCosts = RuntimeCosts(), experts: Sequence[str] = ()) -> tuple[Ledger, Ledger]:
    """(cpu, gpu) ledgers for the head on `output_device`, the last n_gpu blocks on the GPU and each
    block's expert tensors on experts[il] (a mixture-of-experts model; default the block's device)."""
    n_layer = config.n_layer
    layers = layer_devices(n_layer, n_gpu)
    split = bool(sizes.experts) and bool(experts)
    dev_weights = {"cpu": sizes.token_embd + sizes.other, "gpu": 0}
    dev_kv = {"cpu": 0, "gpu": 0}
    dev_ctx = {"cpu": 0, "gpu": 0}  # longest KV a block on the device attends to
    dev_experts = {"cpu": False, "gpu": False}  # the device runs experts / those of the other's blocks
    crosses = {"cpu": False, "gpu": False}
    for il, dev in enumerate(layers):
        extra = sizes.cpu_extra[il] if sizes.cpu_extra else 0
        if split:
            edev, e, r = experts[il], sizes.experts[il], sizes.routers[il]
            e_extra = sizes.experts_cpu_extra[il] if sizes.experts_cpu_extra else 0
            dev_weights[dev] += sizes.blocks[il] - e - r + (extra - e_extra if dev == "cpu" else 0)
            dev_weights[edev] += e + (e_extra if edev == "cpu" else 0)
            dev_weights["cpu"] += r  # the router runs on the host
            dev_experts[edev] = True
            crosses[edev] |= edev != dev
        else:
            dev_weights[dev] += sizes.blocks[il] + (extra if dev == "cpu" else 0)
            dev_experts[dev] = True
        dev_kv[dev] += kv_cache_bytes(config, il, shape)
        dev_ctx[dev] = max(dev_ctx[dev], layer_n_ctx(config, il, shape))
    # the head: on the CPU a tied head is token_embd itself, already counted
    head = sizes.head if (output_device == "gpu" or not sizes.tied_output) else 0
    dev_weights[output_device] += head + sizes.output_norm
    if output_device == "cpu":
        dev_weights["cpu"] += sizes.head_cpu_extra

    gpu_used = n_gpu > 0 or output_device == "gpu" or (split and "gpu" in experts)
    result = []
    for dev, budget, source in (("cpu", budgets.cpu, budgets.cpu_source), ("gpu", budgets.gpu, budgets.gpu_source)):
        buffers = activation_buffers(
            config, shape, runs_blocks=dev_ctx[dev] > 0, holds_head=output_device == dev, is_host=dev == "cpu",
            n_ctx_attn=dev_ctx[dev], runs_experts=dev_experts[dev], crosses=crosses[dev],
        ) if (dev == "cpu" or gpu_used) else {}
        activations = sum(buffers.values())
        if dev == "cpu":
            runtime = costs.cpu_runtime + tokenizer_bytes(config) + (costs.cuda_host_runtime if gpu_used else 0)
        else:
            runtime = costs.gpu_runtime if gpu_used else 0
        draft = costs.draft_cpu if dev == "cpu" else costs.draft_gpu
        used = dev_weights[dev] + dev_kv[dev] + activations + draft
        result.append(Ledger(dev, dev_weights[dev], dev_kv[dev], activations, runtime, _margin(used), budget, source,
                             tuple(buffers.items()), draft))
    return result[0], result[1]


def plan(config, sizes: WeightSizes, *, n_ctx: int, n_batch: int = 512, n_seq: int = 1, kv_type: str = "f16",
         gpu_layers: int | str = 0, budgets: Budgets, check: bool = True, kv_size: int | None = None,
         costs: RuntimeCosts = RuntimeCosts(), measured: Sequence[MeasuredType] = (),
         expert_fixed: Mapping[int, str] = {}) -> Plan:
    """Place the layers and account for every byte. `gpu_layers`: 0 | N | -1 (all) | "auto".
    `measured`: this model's quant types from a quality report, for the "smaller type" remedy.
    `expert_fixed`: {block: device} of the expert tensors the overrides place (-ot, --cpu-moe,
    --n-cpu-moe); the other blocks' experts go with their block.

    "auto": the output head first, then as many of the last blocks as fit the GPU budget with the
    margin; on a mixture-of-experts file every block without its experts first (attention, norms,
    router), then the experts of as many of the last blocks as fit (llama.cpp's --n-cpu-moe). An explicit N that does not fit, or any plan whose CPU side does not fit, raises PlanError
    with the ledger numbers and the remedies when `check` is true; with check=False the plan is
    returned with fits=False (what `edgellm plan` shows).
    """
    if kv_type not in KV_TYPES:
        raise InvalidArgumentError(f"kv_type {kv_type!r} is not one of {', '.join(KV_TYPES)}")
    if min(n_ctx, n_batch, n_seq) < 1:
        raise InvalidArgumentError(f"n_ctx, n_batch and n_seq must be >= 1 (got {n_ctx}, {n_batch}, {n_seq})")
    if len(sizes.blocks) != config.n_layer:
        raise InvalidArgumentError(f"{len(sizes.blocks)} block sizes given for {config.n_layer} layers")
    shape = RunShape(n_ctx, n_batch, n_seq, kv_type, kv_size)
    n_layer = config.n_layer
    notes: list[str] = []

    n_cpu_moe = 0
    if gpu_layers == "auto" and sizes.has_experts:
        n_gpu, output_device, n_cpu_moe = _auto_moe(config, sizes, shape, budgets, costs, notes, expert_fixed)
    elif gpu_layers == "auto":
        n_gpu, output_device = _auto(config, sizes, shape, budgets, costs, notes)
    else:
        try:
            n = int(gpu_layers)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"gpu_layers must be an integer, -1 or 'auto' (got {gpu_layers!r})") from None
        if n < -1:
            raise InvalidArgumentError(f"gpu_layers must be >= -1 (got {n})")
        n_gpu = n_layer if n == -1 else min(n, n_layer)
        output_device = "gpu" if n_gpu > 0 else "cpu"

    layers = layer_devices(n_layer, n_gpu)
    experts = expert_devices(layers, expert_fixed, n_cpu_moe) if sizes.has_experts else ()
    cpu, gpu = ledgers(config, sizes, n_gpu, output_device, shape, budgets, costs, experts)
    result = Plan(layers, output_device, n_gpu, shape, cpu, gpu, tuple(notes), kv_pool=kv_pool_groups(config, shape),
                  experts=experts)
    if not result.fits:
        result = replace(result, remedies=tuple(remedies(config, sizes, result, budgets, costs, measured)))
        if check:
            raise PlanError(_refusal(result))
    return result


def _auto_moe(config, sizes, shape, budgets, costs, notes: list[str], fixed) -> tuple[int, str, int]:
    """(n_gpu, output device, n_cpu_moe) for "auto" on a mixture-of-experts file: every block and the
    head on the GPU with the experts of the first n_cpu_moe blocks on the CPU, the smallest
    n_cpu_moe that fits; when even all experts on the CPU do not fit, fewer blocks (experts on the
    CPU) as _auto places them."""
    n_layer = config.n_layer
    if budgets.gpu <= 0:
        return (*_auto(config, sizes, shape, budgets, costs, notes), 0)
    layers = layer_devices(n_layer, n_layer)

    def gpu_fits(n_gpu, n_cpu) -> bool:
        lay = layer_devices(n_layer, n_gpu)
        return ledgers(config, sizes, n_gpu, "gpu", shape, budgets, costs,
                       expert_devices(lay, fixed, n_cpu))[1].fits

    for n_cpu in range(n_layer + 1):  # the GPU's need only falls as n_cpu grows: the first fit is the most
        if gpu_fits(n_layer, n_cpu):
            on_gpu = expert_devices(layers, fixed, n_cpu).count("gpu")
            notes.append(f"every block's attention, norms and the head on the GPU; the experts of {on_gpu} of "
                         f"{n_layer} blocks on the GPU, the rest on the CPU"
                         + (f" (--n-cpu-moe {n_cpu})" if n_cpu and n_cpu < n_layer and not fixed else ""))
            return n_layer, "gpu", n_cpu
    for n_gpu in range(n_layer - 1, 0, -1):
        if gpu_fits(n_gpu, n_layer):
            notes.append(f"{n_gpu} of {n_layer} blocks on the GPU, every expert on the CPU: one more block would "
                         f"not fit the {format_size(budgets.gpu)} budget")
            return n_gpu, "gpu", n_layer
    n_gpu, out = _auto(config, replace(sizes, experts=(), experts_cpu_extra=(), routers=()), shape, budgets,
                       costs, notes)
    return n_gpu, out, n_layer


def _auto(config, sizes, shape, budgets, costs, notes: list[str]) -> tuple[int, str]:
    if budgets.gpu <= 0:
        notes.append(f"0 GPU layers: no GPU memory to plan for ({budgets.gpu_source}); "
                     "pass --vram SIZE to plan for one")
        return 0, "cpu"
    for n_gpu in range(config.n_layer, -1, -1):  # GPU need only grows with n_gpu: the first fit is the most
        _, gpu = ledgers(config, sizes, n_gpu, "gpu", shape, budgets, costs)
        if gpu.fits:
            if n_gpu < config.n_layer:
                notes.append(
                    f"{n_gpu} of {config.n_layer} blocks on the GPU: one more would need "
                    f"{format_size(ledgers(config, sizes, n_gpu + 1, 'gpu', shape, budgets, costs)[1].total)} "
                    f"of the {format_size(budgets.gpu)} budget"
                )
            return n_gpu, "gpu"
    _, head_only = ledgers(config, sizes, 0, "gpu", shape, budgets, costs)
    notes.append(
        f"0 GPU layers: the GPU budget {format_size(budgets.gpu)} is smaller than the output head alone needs "
        f"({format_size(head_only.total)} = runtime {format_size(head_only.runtime)} + head "
        f"{format_size(head_only.weights)} + activations {format_size(head_only.activations)} + margin "
        f"{format_size(head_only.margin)})"
    )
    return 0, "cpu"


# ============================================================================ verdict
# Smaller quant types to suggest, largest first: (name, bits per weight)
SMALLER_TYPES = (
    ("Q8_0", 8.5), ("Q6_K", 6.5625), ("Q5_K_M", 5.5), ("Q4_K_M", 4.5), ("Q3_K_M", 3.4375), ("Q2_K", 2.625),
)


@dataclass(frozen=True)
class MeasuredType:
    """A quant type of this model as `edgellm quality` measured it (edgellm.quality.store reads them)."""

    name: str  # llama.cpp's file type name, e.g. Q4_K_M
    bits_per_weight: float  # of this model's file in that type (a Q8_0 embedding keeps Gemma's Q4_K_M at 7.4)
    kl_mean: float  # mean KL divergence against the base
    same_top: float  # fraction of positions whose argmax is the base's
    base: str  # the type measured against, e.g. F16
    source: str = ""  # the report's path


def _smaller_type(sizes: WeightSizes, fits, measured: Sequence[MeasuredType]) -> str | None:
    """The "use a smaller type" remedy: among measured types that fit, the one closest to the base
    (lowest mean KL); without a report (or none of its types fitting), the largest generic type that
    fits, its size estimated from typical bits per weight (a measured type is not estimated again)."""
    bpw = sizes.bits_per_weight
    for m in sorted(measured, key=lambda m: (m.kl_mean, -m.bits_per_weight)):
        smaller = sizes.scaled(m.bits_per_weight / bpw)
        if m.bits_per_weight < 0.97 * bpw and fits(sizes=smaller):
            return (f"a {m.name} file of this model ({m.bits_per_weight:.2f} bits/weight, measured mean KL "
                    f"{m.kl_mean:.4f} and top-1 agreement {100 * m.same_top:.1f} % vs {m.base}): weights "
                    f"{format_size(sizes.total)} -> about {format_size(smaller.total)}")
    for name, type_bpw in SMALLER_TYPES:
        smaller = sizes.scaled(type_bpw / bpw)
        if type_bpw < 0.97 * bpw and name not in {m.name for m in measured} and fits(sizes=smaller):
            return (f"a {name} file of this model ({type_bpw:g} bits/weight): weights "
                    f"{format_size(sizes.total)} -> about {format_size(smaller.total)}")
    return None


def remedies(config, sizes: WeightSizes, p: Plan, budgets: Budgets,
             costs: RuntimeCosts = RuntimeCosts(), measured: Sequence[MeasuredType] = ()) -> list[str]:
    """What would make `p` fit, in the order of the design's remedies: KV (KV type, context,
    sequences), then a smaller quant type (a measured one when `measured` has one that fits), then
    the GPU layer count. Each is tried alone from `p`."""
    s = p.shape

    def fits(sizes=sizes, n_gpu=p.n_gpu_layers, output_device=p.output_device, shape=s, experts=p.experts) -> bool:
        cpu, gpu = ledgers(config, sizes, n_gpu, output_device, shape, budgets, costs, experts)
        return cpu.fits and gpu.fits

    def kv(shape: RunShape) -> str:
        before = sum(kv_cache_bytes(config, il, s) for il in range(config.n_layer))
        after = sum(kv_cache_bytes(config, il, shape) for il in range(config.n_layer))
        return f"KV cache {format_size(before)} -> {format_size(after)}"

    out: list[str] = []
    if s.kv_type == "f32" and fits(shape=replace(s, kv_type="f16")):
        out.append(f"--kv-type f16: {kv(replace(s, kv_type='f16'))}")
    n_ctx = _largest(lambda n: fits(shape=replace(s, n_ctx=n)), s.n_ctx - 1) // 256 * 256
    if n_ctx:
        out.append(f"--ctx {n_ctx}: {kv(replace(s, n_ctx=n_ctx))}")
    n_seq = _largest(lambda n: fits(shape=replace(s, n_seq=n)), s.n_seq - 1)
    if n_seq:
        out.append(f"--seqs {n_seq}: {kv(replace(s, n_seq=n_seq))}")

    quant = _smaller_type(sizes, fits, measured)
    if quant:
        out.append(quant)

    if not p.gpu.fits and "gpu" in p.experts:  # experts of the first blocks on the CPU
        for n in range(1, config.n_layer + 1):
            experts = expert_devices(p.layers, {}, n)
            cpu, gpu = ledgers(config, sizes, p.n_gpu_layers, p.output_device, s, budgets, costs, experts)
            if cpu.fits and gpu.fits:
                out.append(f"--n-cpu-moe {n}: GPU total {format_size(p.gpu.total)} -> {format_size(gpu.total)}")
                break
    if not p.gpu.fits:  # fewer blocks on the GPU; the head leaves it last
        for n in range(p.n_gpu_layers - 1, -1, -1):
            experts = expert_devices(layer_devices(config.n_layer, n), {}, 0) if p.experts else ()
            cpu, gpu = ledgers(config, sizes, n, "gpu" if n else "cpu", s, budgets, costs, experts)
            if cpu.fits and gpu.fits:
                out.append(f"--gpu-layers {n}: GPU total {format_size(p.gpu.total)} -> {format_size(gpu.total)}")
                break
    elif budgets.gpu > 0:  # the CPU is short: more blocks on the GPU
        for n in range(p.n_gpu_layers + 1, config.n_layer + 1):
            experts = expert_devices(layer_devices(config.n_layer, n), {}, 0) if p.experts else ()
            cpu, gpu = ledgers(config, sizes, n, "gpu", s, budgets, costs, experts)
            if cpu.fits and gpu.fits:
                out.append(f"--gpu-layers {n}: CPU total {format_size(p.cpu.total)} -> {format_size(cpu.total)}")
                break
    if not out:
        short = (f"the {d.upper()} needs {format_size(l.total - l.budget)} more" for d, l in p.devices.items()
                 if not l.fits)
        out.append("no single change makes it fit: " + ", ".join(short))
    return out


def _largest(fits, hi: int) -> int:
    """The largest n in [1, hi] with fits(n), assuming fits is monotone decreasing in n; 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _refusal(p: Plan) -> str:
    parts = []
    for name, l in p.devices.items():
        if not l.fits:
            parts.append(
                f"{name.upper()} needs {format_size(l.total)} (weights {format_size(l.weights)} + KV "
                f"{format_size(l.kv_cache)} + activations {format_size(l.activations)} + runtime "
                f"{format_size(l.runtime)} + margin {format_size(l.margin)}) but the budget is "
                f"{format_size(l.budget)} ({l.budget_source})"
            )
    return (f"the plan ({p.layer_map()}, n_ctx {p.shape.n_ctx}) does not fit: " + "; ".join(parts)
            + ". Would fit: " + " | ".join(p.remedies))

