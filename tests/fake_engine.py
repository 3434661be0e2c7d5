"""A stand-in for `edgellm.Model` with the surface the TUI uses (chat, stats, plan, n_ctx, n_vocab,
metadata), streaming a canned answer slowly so the UI can be developed and tested without weights.

    python tests/fake_engine.py [--delay 0.05] [--gpu-layers 12]    # the real app on a FakeModel

Token counting is one token per whitespace-separated word plus 4 per message (role markers), so a
test can work out exactly when the context is full.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from edgellm.errors import ContextFullError, InvalidArgumentError

DEFAULT_REPLY = (
    "Here is a **short** answer.\n\n"
    "- one point\n- another point\n\n"
    "```python\nprint('hello')\n```\n\n"
    "And a closing sentence with a few more words to stream slowly."
)
TOKENS_PER_MESSAGE = 4
MIB = 1024 * 1024


@dataclass(frozen=True)
class FakeChunk:
    token: int
    text: str
    finish_reason: str | None = None    # like edgellm.Chunk: "stop", "length" or None


@dataclass(frozen=True)
class FakePlan:
    layers: tuple[str, ...]
    output_device: str
    n_gpu_layers: int


@dataclass
class FakeStats:
    ttft_s: float | None = None
    prompt_tokens: int = 0
    prompt_tps: float | None = None
    gen_tokens: int = 0
    gen_tps: float | None = None
    tpot_ms: float | None = None
    device_ms: dict[str, float] = field(default_factory=dict)
    memory: dict[str, dict[str, int]] = field(default_factory=dict)
    n_past: int = 0


def count_tokens(messages: list[dict]) -> int:
    return sum(len(m["content"].split()) + TOKENS_PER_MESSAGE for m in messages)


class FakeModel:
    """reply: the answer every chat streams (split into word tokens, whitespace kept);
    delay_s: seconds per token; gpu_layers: how many of n_layer blocks "run" on the GPU."""

    def __init__(self, reply: str = DEFAULT_REPLY, *, delay_s: float = 0.02, n_ctx: int = 512,
                 n_layer: int = 30, gpu_layers: int = 0) -> None:
        self.reply = reply
        self.delay_s = delay_s
        self.n_ctx = n_ctx
        self.n_vocab = 49152
        self.metadata = {"general.name": "FakeLM-135M", "general.architecture": "llama"}
        layers = tuple("gpu" if i < gpu_layers else "cpu" for i in range(n_layer))
        self.plan = FakePlan(layers, "gpu" if gpu_layers == n_layer else "cpu", gpu_layers)
        self.stats = FakeStats(memory=self._memory())
        self.calls: list[dict] = []          # every chat request: messages + sampling
        self.streams_closed = 0              # generators that were closed (stopped or finished)
        self.tokens_streamed = 0
        self.streaming = threading.Event()   # set while a generator is between first and last token

    def _memory(self) -> dict[str, dict[str, int]]:
        gpu_share = self.plan.n_gpu_layers / len(self.plan.layers)
        weights, kv = 98 * MIB, 45 * MIB * self.n_ctx // 4096
        memory = {"cpu": {"weights": round(weights * (1 - gpu_share)), "kv_cache": round(kv * (1 - gpu_share)),
                          "activations": 3 * MIB, "runtime": 60 * MIB}}
        if self.plan.n_gpu_layers:
            memory["gpu"] = {"weights": round(weights * gpu_share), "kv_cache": round(kv * gpu_share),
                             "activations": 8 * MIB, "runtime": 300 * MIB}
        return memory

    def weights_read_per_token(self) -> dict[str, int]:
        """Model.weights_read_per_token: the fake's 98 MiB of weights split as its layers are."""
        gpu_share = self.plan.n_gpu_layers / len(self.plan.layers)
        read = {"cpu": round(90 * MIB * (1 - gpu_share))}
        if self.plan.n_gpu_layers:
            read["gpu"] = round(90 * MIB * gpu_share)
        return read

    def tokens(self) -> list[str]:
        """The reply as streamed chunks: each word with the whitespace that follows it."""
        pieces, current = [], ""
        for ch in self.reply:
            if not ch.isspace() and current and current[-1].isspace():
                pieces.append(current)
                current = ""
            current += ch
        return pieces + [current] if current else pieces

    def chat(self, messages: list[dict], *, max_tokens: int = 256, temperature: float = 0.8,
             top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, repeat_penalty: float = 1.0,
             seed: int | None = None):
        if temperature < 0 or not 0 < top_p <= 1:
            raise InvalidArgumentError(f"bad sampling settings: temperature={temperature}, top_p={top_p}")
        for m in messages:
            if set(m) != {"role", "content"} or m["role"] not in ("system", "user", "assistant"):
                raise InvalidArgumentError(f"bad message {m!r}")
        self.calls.append({"messages": [dict(m) for m in messages], "max_tokens": max_tokens,
                           "temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                           "repeat_penalty": repeat_penalty, "seed": seed})
        n_prompt = count_tokens(messages)
        if n_prompt >= self.n_ctx:      # raised by the call, before any chunk, as edgellm.Model does
            raise ContextFullError(
                f"the prompt is {n_prompt} tokens but the context holds {self.n_ctx}; "
                "shorten the prompt or load with a larger n_ctx (-c)")
        return self._stream(n_prompt, max_tokens)

    def _stream(self, n_prompt: int, max_tokens: int):
        """The chunks, paced like decoding: a prefill pause, then delay_s per token."""
        start = time.perf_counter()
        stats = FakeStats(prompt_tokens=n_prompt, memory=self._memory(), n_past=0)
        self.stats = stats
        try:
            time.sleep(self.delay_s)                        # "prefill"
            stats.n_past = n_prompt
            stats.prompt_tps = n_prompt / (time.perf_counter() - start)
            self.streaming.set()
            pieces = self.tokens()
            for i, text in enumerate(pieces[:max_tokens]):
                if i:
                    time.sleep(self.delay_s)
                now = time.perf_counter()
                if stats.ttft_s is None:
                    stats.ttft_s = now - start
                stats.gen_tokens += 1
                stats.n_past += 1
                decode_s = now - start - stats.ttft_s
                stats.gen_tps = (stats.gen_tokens - 1) / decode_s if decode_s > 0 else None
                stats.tpot_ms = 1000 * decode_s / (stats.gen_tokens - 1) if stats.gen_tokens > 1 else None
                # a deterministic wobble so the sparklines have something to draw
                cpu_ms = 1000 * self.delay_s * (0.6 + 0.1 * (i % 4))
                stats.device_ms = {"cpu": cpu_ms}
                if self.plan.n_gpu_layers:
                    stats.device_ms.update(gpu=cpu_ms / 3, transfer=0.2)
                self.tokens_streamed += 1
                # like the real model: the last chunk says why the answer ends
                if stats.n_past >= self.n_ctx or i + 1 == max_tokens:
                    yield FakeChunk(1000 + i, text, "length")
                    return
                yield FakeChunk(1000 + i, text, "stop" if i + 1 == len(pieces) else None)
        finally:
            self.streaming.clear()
            self.streams_closed += 1


def main() -> int:
    import argparse

    from edgellm.tui.app import run_chat

    parser = argparse.ArgumentParser(description="Run the edgellm chat UI on a fake model.")
    parser.add_argument("--delay", type=float, default=0.05, help="seconds per token")
    parser.add_argument("--gpu-layers", type=int, default=0)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--load-s", type=float, default=1.0, help="seconds the fake loader takes")
    parser.add_argument("--repeat", type=int, default=1, help="repeat the canned reply N times")
    parser.add_argument("--resume", action="store_true", help="reopen the last kept chat")
    args = parser.parse_args()

    def load() -> FakeModel:
        time.sleep(args.load_s)
        reply = "\n\n".join([DEFAULT_REPLY] * args.repeat)
        return FakeModel(reply, delay_s=args.delay, n_ctx=args.ctx, gpu_layers=args.gpu_layers)

    return run_chat(load, resume=args.resume)


if __name__ == "__main__":
    raise SystemExit(main())
