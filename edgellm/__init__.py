"""edgellm: run GGUF language models on modest machines.

`import edgellm` stays light: numba, textual and cupy are imported only when needed.
"""
from edgellm.errors import EdgeLLMError

__version__ = "0.1.0"
__all__ = ["load", "quantize", "EdgeLLMError", "Model", "Chunk", "__version__"]


def load(path=None, **kwargs):
    """Load a GGUF model (path None -> the default model). See `edgellm.api.load`."""
    from edgellm.api import load as _load

    return _load(path, **kwargs)


def quantize(src, dst, type="Q4_K_M", **options):
    """Quantize GGUF file src into dst with llama-quantize's types and recipes. See
    `edgellm.quality.quantize.quantize`."""
    from edgellm.quality.quantize import quantize as _quantize

    return _quantize(src, dst, type, **options)


def __getattr__(name):
    if name in ("Model", "Chunk"):
        from edgellm import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
