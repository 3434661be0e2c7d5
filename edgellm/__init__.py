"""edgellm: run GGUF language models on modest machines.

`import edgellm` stays light: numba, textual and cupy are imported only when needed.
"""
from edgellm.errors import EdgeLLMError

__version__ = "0.1.0"
__all__ = ["load", "EdgeLLMError", "Model", "Chunk", "__version__"]


def load(path=None, **kwargs):
    """Load a GGUF model (path None -> the default model). See `edgellm.api.load`."""
    from edgellm.api import load as _load

    return _load(path, **kwargs)


def __getattr__(name):
    if name in ("Model", "Chunk"):
        from edgellm import api

        return getattr(api, name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
