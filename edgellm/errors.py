"""One exception hierarchy. Every message says what was wrong and what to do about it.

Messages quote text from files (keys, names, token strings) that may hold anything, so a message
is always shown as one printable line: control and format characters escaped, length capped."""
from __future__ import annotations

import unicodedata

MAX_MESSAGE = 1000  # characters of an error message shown
MAX_VALUE = 80  # characters of a value from a file quoted in a message or shown by `info`


def printable(text: object, limit: int | None = MAX_VALUE) -> str:
    """`text` as one line safe for a terminal: control characters (ESC, newlines, C1), format
    characters (bidi overrides, zero-width), line/paragraph separators and lone surrogates become
    \\xNN / \\uNNNN escapes; longer than `limit` characters, it is cut with a count of the rest."""
    s = text if isinstance(text, str) else str(text)
    cut = 0
    if limit is not None and len(s) > limit:
        s, cut = s[:limit], len(s) - limit
    if not s.isprintable():  # the common case needs no work
        out = []
        for ch in s:
            if ch.isprintable() or ch == " ":
                out.append(ch)
            elif unicodedata.category(ch) == "Zs":  # no-break and other spaces
                out.append(" ")
            else:
                o = ord(ch)
                out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
        s = "".join(out)
    return s + (f"... ({cut} more characters)" if cut else "")


class EdgeLLMError(Exception):
    """Base of every error edgellm raises on purpose. `str()` is one printable line."""

    def __str__(self) -> str:
        return printable(super().__str__(), MAX_MESSAGE)


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


class MetadataValueError(GGUFError):
    """A metadata value has the wrong type (an array where a number belongs, a number where text
    belongs, NaN) or is out of range (0 heads, a negative epsilon, a token id past the vocabulary)."""


class ModelShapeError(TensorShapeError):
    """A tensor's shape disagrees with the model's metadata (head counts, widths, vocabulary) or a
    tensor the model needs is missing."""


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


class TemplateLimitError(TemplateError):
    """The chat template ran past a limit: output size, string size, loop steps or render time."""


class PlanError(EdgeLLMError):
    """The requested placement does not fit the memory budget."""


class GPUUnavailableError(EdgeLLMError):
    """GPU layers were requested but CuPy or a CUDA device is missing."""


class OutOfMemoryError(EdgeLLMError):
    """A device ran out of memory while loading."""
