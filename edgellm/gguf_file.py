"""GGUF reader: memory-mapped, validated, zero-copy.

Layout of a GGUF (v2/v3, little-endian) file:

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv × (key: string, value_type u32, value)
    n_tensors × (name: string, n_dims u32, ne: u64[n_dims], ggml_type u32, offset u64)
    padding to `general.alignment` (default 32)
    tensor data; each tensor at data_start + offset
    string = u64 length + UTF-8 bytes; array = elem_type u32 + count u64 + elements

The gguf package's constants (value types, quant sizes) are used; its GGUFReader is not, because it
builds a Python object per array element (seconds for a large vocabulary), where this reader keeps
each array as it lies in the file. Every count read from the file is checked against the bytes left
before anything is sized by it.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from edgellm.errors import (
    GGUFError,
    NotGGUFError,
    TensorBoundsError,
    TensorShapeError,
    TruncatedFileError,
    UnsupportedTensorTypeError,
    UnsupportedVersionError,
    printable,
)
from edgellm.quants import QuantType, quant_type

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NESTING = 8  # arrays of arrays: deeper means a crafted header (Python would hit its recursion limit)

# value type -> (struct code, byte size) for fixed-size scalars
_SCALARS = {
    GGUFValueType.UINT8: ("B", 1),
    GGUFValueType.INT8: ("b", 1),
    GGUFValueType.UINT16: ("H", 2),
    GGUFValueType.INT16: ("h", 2),
    GGUFValueType.UINT32: ("I", 4),
    GGUFValueType.INT32: ("i", 4),
    GGUFValueType.FLOAT32: ("f", 4),
    GGUFValueType.BOOL: ("?", 1),
    GGUFValueType.UINT64: ("Q", 8),
    GGUFValueType.INT64: ("q", 8),
    GGUFValueType.FLOAT64: ("d", 8),
}
_NP_DTYPES = {
    GGUFValueType.UINT8: np.uint8,
    GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32,
    GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32,
    GGUFValueType.BOOL: np.bool_,
    GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT64: np.float64,
}


class FileBytes:
    """A mapped file's bytes (uint8 array over the map; None once the file is closed), shared by a
    GGUFFile and its tensors. The tensors refer to this, not to the GGUFFile: the file holds its
    tensors, and tensors holding the file would make a reference cycle that keeps the map (the
    whole model) until the cycle collector runs; as it is, dropping a model unmaps at once, and
    a tensor taken from a file no longer referenced still reads its bytes."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray | None):
        self.array = array


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: QuantType
    ne: tuple[int, ...]  # GGUF order: ne[0] = elements per row
    offset: int  # absolute byte offset in the file
    nbytes: int
    _bytes: "FileBytes"  # the file's bytes, shared with its GGUFFile (which is not referenced)

    @property
    def n_cols(self) -> int:
        return self.ne[0]

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.ne[1:], dtype=np.int64)) if len(self.ne) > 1 else 1

    @property
    def shape(self) -> tuple[int, int]:
        """2-D (n_rows, n_cols) view of the tensor; 1-D tensors are one row."""
        return (self.n_rows, self.n_cols)

    @property
    def n_elements(self) -> int:
        return self.n_rows * self.n_cols

    @property
    def data(self) -> np.ndarray:
        """uint8 (n_rows, row_bytes) view of the mapped file; never a copy."""
        whole = self._bytes.array
        if whole is None:
            raise GGUFError(f"tensor '{printable(self.name)}': its GGUF file was closed; open the file again")
        flat = whole[self.offset : self.offset + self.nbytes]
        return flat.reshape(self.n_rows, self.nbytes // self.n_rows)

    def rows(self, start: int, n: int) -> "TensorInfo":
        """Rows start..start+n of a 2-D tensor as a tensor of its own, in place in the file (a fused
        tensor's parts: phi3's attn_qkv, its ffn_up holding gate and up)."""
        if len(self.ne) != 2 or start < 0 or n < 1 or start + n > self.n_rows:
            raise GGUFError(f"tensor '{printable(self.name)}' has no rows {start}..{start + n - 1}")
        row = self.nbytes // self.n_rows
        return replace(self, name=f"{self.name}[{start}:{start + n}]", ne=(self.ne[0], n),
                       offset=self.offset + start * row, nbytes=n * row)

    def expert(self, e: int) -> "TensorInfo":
        """Expert e of a 3-D expert tensor (ne = (cols, rows, experts)) as a 2-D tensor of its own, in
        place in the file (a mixture-of-experts block's ffn_*_exps)."""
        if len(self.ne) != 3 or not 0 <= e < self.ne[2]:
            raise GGUFError(f"tensor '{printable(self.name)}' has no expert {e}")
        size = self.nbytes // self.ne[2]
        return replace(self, name=f"{self.name}[{e}]", ne=(self.ne[0], self.ne[1]),
                       offset=self.offset + e * size, nbytes=size)

    def as_float32(self) -> np.ndarray:
        """float32 (n_rows, n_cols); a zero-copy view for F32 tensors, dequantized otherwise."""
        if self.qtype.name == "F32":
            return self.data.view(np.float32)
        return self.qtype.dequantize_reference(self.data).reshape(self.shape)


class StringArray(Sequence):
    """A GGUF array of strings, kept as the file keeps it: the UTF-8 bytes of all strings in one
    `bytes` and an offset per string; a string is decoded when it is read. A vocabulary as a list
    of Python strings costs ~80 bytes a token more (4 MiB for SmolLM2's 49k tokens, 20 MiB for
    Gemma-3's 262k). Indexing, slicing (a list), iteration, `in`, `index` and `==` with a list
    work as on a list; bytes that are not UTF-8 decode as lone surrogates (surrogateescape)."""

    __slots__ = ("_blob", "_offsets")

    def __init__(self, strings=()):
        encoded = [s.encode("utf-8", "surrogateescape") for s in strings]
        self._blob = b"".join(encoded)
        self._offsets = array("q", [0])
        for e in encoded:
            self._offsets.append(self._offsets[-1] + len(e))

    @classmethod
    def from_records(cls, records: memoryview, lengths: list[int]) -> "StringArray":
        """From GGUF's records (u64 length + bytes) laid end to end, with their lengths."""
        self = cls.__new__(cls)
        n = np.asarray(lengths, dtype=np.int64)
        keep = np.ones(len(records), dtype=bool)  # drop each record's 8-byte length
        if len(n):
            heads = np.cumsum(n + 8) - n - 8
            keep[(heads[:, None] + np.arange(8)).ravel()] = False
        self._blob = np.frombuffer(records, dtype=np.uint8)[keep].tobytes()
        self._offsets = array("q", [0])
        self._offsets.frombytes(np.cumsum(n).tobytes())
        return self

    def utf8(self) -> tuple[bytes, np.ndarray]:
        """(the UTF-8 bytes of all strings, int64 offsets (n + 1,)): string i is bytes[off[i]:off[i + 1]]."""
        return self._blob, np.frombuffer(self._offsets, dtype=np.int64)

    def records(self) -> bytes:
        """GGUF's records (u64 little-endian length + bytes) laid end to end: from_records' input."""
        off = np.frombuffer(self._offsets, dtype=np.int64)
        n = np.diff(off)
        out = np.empty(len(self._blob) + 8 * len(n), dtype=np.uint8)
        heads = off[:-1] + 8 * np.arange(len(n))  # where record i starts
        out[(heads[:, None] + np.arange(8)).ravel()] = n.astype("<u8").view(np.uint8)
        owner = np.repeat(np.arange(len(n)), n)  # the string each blob byte belongs to
        out[np.arange(len(self._blob)) + 8 * (owner + 1)] = np.frombuffer(self._blob, dtype=np.uint8)
        return out.tobytes()

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def max_bytes(self) -> int:
        """UTF-8 bytes of the longest string (0 when there is none)."""
        if len(self._offsets) < 2:
            return 0
        return int(np.diff(np.frombuffer(self._offsets, dtype=np.int64)).max())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._offsets) - 1
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string index {i} out of range ({n} strings)")
        return self._blob[self._offsets[i]:self._offsets[i + 1]].decode("utf-8", "surrogateescape")

    def __iter__(self):
        blob, off = self._blob, self._offsets
        for i in range(len(off) - 1):
            yield blob[off[i]:off[i + 1]].decode("utf-8", "surrogateescape")

    def __eq__(self, other) -> bool:
        if isinstance(other, StringArray):
            return self._blob == other._blob and self._offsets == other._offsets
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    @property
    def nbytes(self) -> int:
        return len(self._blob) + 8 * len(self._offsets)


class _Cursor:
    """Bounds-checked little-endian reads from the header bytes."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path
        self.what = "header"
        self.depth = 0  # arrays of arrays being read

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise TruncatedFileError(
                f"{self.path}: file truncated in the header while reading {self.what} "
                f"(needs {n} bytes at offset {self.pos}, file has {len(self.buf)}); re-download the file"
            )

    def scalar(self, code: str, size: int):
        self.need(size)
        (v,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += size
        return v

    def u32(self) -> int:
        return self.scalar("I", 4)

    def u64(self) -> int:
        return self.scalar("Q", 8)

    def string(self) -> str:
        n = self.u64()
        self.need(n)
        s = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="surrogateescape")
        self.pos += n
        return s

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            return self.array()
        try:
            code, size = _SCALARS[GGUFValueType(vtype)]
        except (ValueError, KeyError):
            raise GGUFError(f"{self.path}: corrupt header: unknown value type {vtype} in {self.what}") from None
        return self.scalar(code, size)

    def array(self) -> Any:
        etype = self.u32()
        count = self.u64()
        if etype == GGUFValueType.STRING:
            # each string takes at least its 8-byte length: check before sizing anything by count
            self.need(count * 8)
            start = pos = self.pos
            buf, unpack, end = self.buf, struct.unpack_from, len(self.buf)
            lengths = []
            for _ in range(count):
                if pos + 8 > end:
                    self.pos = pos
                    self.need(8)
                (n,) = unpack("<Q", buf, pos)
                if pos + 8 + n > end:
                    self.pos = pos + 8
                    self.need(n)
                pos += 8 + n
                lengths.append(n)
            self.pos = pos
            return StringArray.from_records(buf[start:pos], lengths)
        if etype == GGUFValueType.ARRAY:
            self.need(count * 12)
            self.depth += 1
            if self.depth > MAX_NESTING:
                raise GGUFError(f"{self.path}: corrupt header: arrays nested more than {MAX_NESTING} "
                                f"deep in {self.what}")
            items = [self.array() for _ in range(count)]
            self.depth -= 1
            return items
        try:
            dtype = np.dtype(_NP_DTYPES[GGUFValueType(etype)]).newbyteorder("<")
        except (ValueError, KeyError):
            raise GGUFError(f"{self.path}: corrupt header: unknown array type {etype} in {self.what}") from None
        nbytes = count * dtype.itemsize
        self.need(nbytes)
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += nbytes
        return arr


class GGUFFile:
    """A validated, memory-mapped GGUF file. Tensor data is never read at open."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            st = self.path.stat()
            if not stat.S_ISREG(st.st_mode) and not stat.S_ISDIR(st.st_mode):
                # a FIFO would block open() until a writer appears; a device or socket is no model
                raise GGUFError(f"{self.path}: not a regular file (a pipe, socket or device); "
                                "pass a .gguf file")
            self.file_size = st.st_size
            fh = open(self.path, "rb")
        except FileNotFoundError:
            from edgellm.errors import ModelNotFoundError

            raise ModelNotFoundError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise GGUFError(f"{self.path}: is a directory, not a GGUF file") from None
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open: {exc.strerror}") from None
        with fh:
            head = fh.read(4)
            if head != GGUF_MAGIC:
                raise NotGGUFError(
                    f"{self.path}: not a GGUF file (magic {head!r}, expected b'GGUF'); "
                    "edgellm reads llama.cpp's GGUF format"
                )
            if self.file_size < 24:
                raise TruncatedFileError(f"{self.path}: file truncated ({self.file_size} bytes, header needs 24)")
            try:
                self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as exc:  # ENOMEM: no address space left for the map
                from edgellm.errors import OutOfMemoryError

                raise OutOfMemoryError(
                    f"{self.path}: cannot map the {self.file_size}-byte file into memory "
                    f"({getattr(exc, 'strerror', None) or exc}); close other models or programs") from None
        self._parse()
        # The header (a vocabulary's strings and scores: 6 MiB for a 262k one) has been copied
        # out; its pages would otherwise stay resident for the life of the map. They are clean
        # pages of a shared file map: dropped now, read back from the file if ever touched.
        header = self.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        if header and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED, 0, header)

    # ---------------------------------------------------------------------------------------
    def _parse(self) -> None:
        cur = _Cursor(memoryview(self._mmap), self.path)
        cur.pos = 4
        self.version = cur.u32()
        if self.version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if self.version > 0xFFFF else ""
            raise UnsupportedVersionError(
                f"{self.path}: GGUF version {self.version}{hint} is not supported; supported versions: "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))}. Re-convert the model with a current llama.cpp"
            )
        n_tensors = cur.u64()
        n_kv = cur.u64()
        # smallest key/value: 8-byte key length + 4-byte type + 1-byte value; smallest tensor info: 8+4+8+4+8
        if n_kv * 13 > self.file_size or n_tensors * 32 > self.file_size:
            raise TruncatedFileError(
                f"{self.path}: header claims {n_tensors} tensors and {n_kv} metadata keys, "
                f"more than a {self.file_size}-byte file can hold (corrupt or truncated file)"
            )

        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, int] = {}
        for i in range(n_kv):
            cur.what = f"metadata key #{i}"
            key = cur.string()
            cur.what = f"metadata value of '{printable(key)}'"
            vtype = cur.u32()
            self.metadata[key] = cur.value(vtype)
            self.metadata_types[key] = vtype

        raw_tensors = []
        for i in range(n_tensors):
            cur.what = f"tensor info #{i}"
            name = cur.string()
            cur.what = f"tensor info of '{printable(name)}'"
            n_dims = cur.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                raise TensorShapeError(
                    f"{self.path}: tensor '{printable(name)}' has {n_dims} dimensions (1..{MAX_DIMS} allowed)")
            ne = tuple(cur.u64() for _ in range(n_dims))
            type_id = cur.u32()
            offset = cur.u64()
            raw_tensors.append((name, ne, type_id, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment = {printable(repr(alignment))} is not a power of two")
        self.alignment = alignment
        self.data_offset = (cur.pos + alignment - 1) // alignment * alignment
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self._bytes = FileBytes(self._map)
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, offset in raw_tensors:
            self.tensors[name] = self._tensor_info(name, ne, type_id, offset)

    def _tensor_info(self, name: str, ne: tuple[int, ...], type_id: int, offset: int) -> TensorInfo:
        shown = printable(name)  # for messages: a name from the file may hold anything
        if name in self.tensors:
            raise GGUFError(f"{self.path}: tensor '{shown}' appears twice in the header")
        try:
            qtype = quant_type(type_id)
        except UnsupportedTensorTypeError as exc:
            raise UnsupportedTensorTypeError(f"{self.path}: tensor '{shown}': {exc}") from None
        if any(d <= 0 for d in ne) or any(d >= 1 << 40 for d in ne):
            raise TensorShapeError(f"{self.path}: tensor '{shown}' has an invalid shape {list(ne)}")
        if ne[0] % qtype.block_size:
            raise TensorShapeError(
                f"{self.path}: tensor '{shown}' rows of {ne[0]} elements are not a whole number of "
                f"{qtype.name} blocks ({qtype.block_size} elements each)"
            )
        n_elements = 1
        for d in ne:
            n_elements *= d
        nbytes = n_elements // qtype.block_size * qtype.type_size
        if offset % self.alignment:
            raise TensorBoundsError(
                f"{self.path}: tensor '{shown}' offset {offset} is not aligned to {self.alignment} bytes (corrupt file)"
            )
        start = self.data_offset + offset
        if start >= self.file_size:
            raise TensorBoundsError(
                f"{self.path}: tensor '{shown}' starts at byte {start}, past the end of the "
                f"{self.file_size}-byte file (corrupt header or truncated file)"
            )
        if start + nbytes > self.file_size:
            raise TruncatedFileError(
                f"{self.path}: tensor '{shown}' ({qtype.name}, {list(ne)}, {nbytes} bytes at byte {start}) "
                f"reaches past the end of the {self.file_size}-byte file: the file is truncated; re-download it"
            )
        return TensorInfo(name, qtype, ne, start, nbytes, self._bytes)

    # ---------------------------------------------------------------------------------------
    @cached_property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch is None:
            from edgellm.errors import MissingMetadataError

            raise MissingMetadataError(f"{self.path}: metadata key 'general.architecture' is missing")
        if not isinstance(arch, str):
            from edgellm.errors import MetadataValueError
            from edgellm.validate import describe

            raise MetadataValueError(f"{self.path}: metadata key 'general.architecture' is "
                                     f"{describe(arch)}; expected a string (corrupt or hostile file)")
        return arch

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            from edgellm.errors import MissingMetadataError

            raise MissingMetadataError(f"{self.path}: required tensor '{printable(name)}' is missing") from None

    def close(self) -> None:
        self._map = None
        if hasattr(self, "_bytes"):
            self._bytes.array = None
        try:
            self._mmap.close()
        except BufferError:  # views still alive; the mapping goes when they do
            pass

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"
