"""One exception hierarchy. Every message says what was wrong and what to do about it."""


class EdgeLLMError(Exception):
    """Base of every error edgellm raises on purpose."""


# --- GGUF file problems ------------------------------------------------------------------------
class GGUFError(EdgeLLMError):
    """The file is not a GGUF file edgellm can read."""


class NotGGUFError(GGUFError):
    """Wrong magic: not a GGUF file at all."""


class UnsupportedVersionError(GGUFError):
    """A GGUF version this reader does not know."""


class TruncatedFileError(GGUFError):
    """The header or the tensor data ends before it should."""


class TensorBoundsError(GGUFError):
    """A tensor's offset or size reaches past the end of the file."""


class UnsupportedTensorTypeError(GGUFError):
    """A tensor type id that is unknown or that edgellm has no kernels for."""


class TensorShapeError(GGUFError):
    """A tensor's shape does not fit its type's block size or byte size."""


class MissingMetadataError(GGUFError):
    """A metadata key the architecture needs is absent."""


class UnsupportedArchitectureError(EdgeLLMError):
    """`general.architecture` names an architecture edgellm does not implement."""


# --- Runtime / user input --------------------------------------------------------------------
class ModelNotFoundError(EdgeLLMError):
    """No such file, and no known model name."""


class DownloadError(EdgeLLMError):
    """Fetching a model from the package registry failed."""


class ContextFullError(EdgeLLMError):
    """More tokens than the context (n_ctx) holds."""


class KVCacheFullError(EdgeLLMError):
    """The KV cache has no free block for a sequence (others hold them all)."""


class InvalidArgumentError(EdgeLLMError, ValueError):
    """A parameter value out of range (temperature < 0, top_p outside (0, 1], ...)."""


class TokenizerError(EdgeLLMError):
    """The tokenizer metadata is missing or inconsistent, or a token id is out of range."""


class TemplateError(EdgeLLMError):
    """The chat template failed to render (or tried something the sandbox forbids)."""


class PlanError(EdgeLLMError):
    """The requested placement does not fit the memory budget."""


class GPUUnavailableError(EdgeLLMError):
    """GPU layers were requested but CuPy or a CUDA device is missing."""


class OutOfMemoryError(EdgeLLMError):
    """A device ran out of memory while loading."""
