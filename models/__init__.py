"""Architectures, one module per GGUF `general.architecture`, found by name.

Each module exports `Model`, a `models.decoder.Decoder` subclass holding the architecture's choices
(RoPE layout, activation, sliding-window layers, what its files carry).
"""
from __future__ import annotations

import importlib
from types import ModuleType

# GGUF architecture name -> module in this package. Aliases share a module.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "granite": "granite",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2moe",
    "qwen3moe": "qwen3moe",
    "smollm3": "smollm3",
}


def architecture(name: str, path=None) -> ModuleType:
    from edgellm.errors import UnsupportedArchitectureError

    module = ARCHITECTURES.get(name)
    if module is None:
        where = f"{path}: " if path else ""
        raise UnsupportedArchitectureError(
            f"{where}architecture '{name}' is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return importlib.import_module(f"edgellm.models.{module}")
