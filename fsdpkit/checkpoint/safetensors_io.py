"""Safetensors files without torch: a validating header parser and a streaming writer.

Format (huggingface/safetensors): 8 bytes little-endian u64 N, N bytes of JSON header
(`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`),
then the byte buffer, which the offsets index with no holes.

`read_header(path)` checks everything a reader relies on before any byte of data is used:
header length against the file size and the 100 MB limit, the JSON, every dtype, that each
tensor's byte span equals numel * itemsize, that the spans tile the buffer exactly and that
the file ends where the buffer does. Errors are `DataCheckError` naming the file.

`StreamingWriter` lays out the header from (name, dtype, shape) alone, pads it with spaces to
a multiple of 8 (as the safetensors library does), writes it, then accepts the data bytes in
order in any number of pieces: memory is whatever the caller's buffer is, never a tensor.
Entries are stored in the order given, after a stable sort by descending itemsize so every
tensor starts aligned to its element size. The result reads back with `safetensors.safe_open`.

`write_behind=True` (convert, reshard) starts the writeback of every completed
`WRITE_BEHIND_BYTES` window at once (`posix_fadvise(DONTNEED)`: asynchronous writeback,
then clean pages leave the page cache; dirty data is never dropped), so the disk works while
the copy goes on and the final fsync has little left to do; it also keeps a multi-GB output
from filling the page cache. Durability is unchanged: `close()` still fsyncs.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataCheckError
from .format import MAX_HEADER_BYTES, dtype_info, is_known_dtype, numel

WRITE_BEHIND_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # absolute file offset of the data buffer
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def file_size(self) -> int:
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)


def read_header(path: str | Path, *, expected_size: int | None = None) -> Header:
    """Parse and validate the header of a safetensors file (see the module docstring)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise DataCheckError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise DataCheckError(f"{path}: header claims {header_len} bytes, over the {MAX_HEADER_BYTES}-byte limit")
            if 8 + header_len > size:
                raise DataCheckError(f"{path}: header claims {header_len} bytes but the file has only {size} bytes")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise DataCheckError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise DataCheckError(f"{path}: is a directory, expected a safetensors file") from None
    except PermissionError as error:
        raise DataCheckError(f"{path}: cannot read ({error.strerror})") from None
    if expected_size is not None and size != expected_size:
        raise DataCheckError(f"{path}: file is {size} bytes, the manifest says {expected_size}")
    header = parse_header_bytes(raw, path=path)
    end = header.file_size
    if end != size:
        raise DataCheckError(f"{path}: data ends at byte {end} but the file is {size} bytes (truncated or extended)")
    return header


def parse_header_bytes(raw: bytes, *, path: Path) -> Header:
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as error:
        raise DataCheckError(f"{path}: safetensors header is not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise DataCheckError(f"{path}: safetensors header is a {type(document).__name__}, expected an object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise DataCheckError(f"{path}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        tensors[name] = _tensor_info(name, entry, path)
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items())
    position = 0
    for begin, end, name in spans:
        if begin != position:
            raise DataCheckError(f"{path}: tensor {name!r} starts at byte {begin}, expected {position} (hole or overlap)")
        position = end
    return Header(path=path, data_start=8 + len(raw), tensors=tensors, metadata=dict(metadata))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate keys {duplicates[:3]}")
    return dict(pairs)


def _tensor_info(name: str, entry: object, path: Path) -> TensorInfo:
    if not isinstance(entry, dict):
        raise DataCheckError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not is_known_dtype(dtype):
        raise DataCheckError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise DataCheckError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise DataCheckError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    expected = numel(shape) * dtype_info(dtype).itemsize
    if offsets[1] - offsets[0] != expected:
        raise DataCheckError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def layout_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[str, TensorInfo]]]:
    """The header bytes (length prefix included, padded to 8) and each entry's data span, in write order."""
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError(f"duplicate or reserved tensor names in one safetensors file: {names}")
    ordered = sorted(entries, key=lambda e: -dtype_info(e[1]).itemsize)  # stable: keeps caller order within a size
    document: dict[str, object] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    spans, position = [], 0
    for name, dtype, shape in ordered:
        size = numel(shape) * dtype_info(dtype).itemsize
        info = TensorInfo(dtype, tuple(int(d) for d in shape), position, position + size)
        document[name] = {"dtype": dtype, "shape": list(info.shape), "data_offsets": [info.begin, info.end]}
        spans.append((name, info))
        position += size
    raw = json.dumps(document, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


class StreamingWriter:
    """Write one safetensors file whose header is known up front; data arrives in pieces.

    Usage::

        with StreamingWriter(path, entries, metadata={"format": "pt"}) as w:
            for name, info in w.order:        # the order data must be written in
                w.write(piece)                # any number of pieces per tensor, in order

    `close()` checks every byte was written, fsyncs and closes. On an exception inside the
    `with` block the partial file is removed.
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]], *,
                 metadata: dict[str, str] | None = None, write_behind: bool = False):
        self.path = Path(path)
        header, self.order = layout_header(entries, metadata)
        self.size = len(header) + sum(info.nbytes for _, info in self.order)
        self._file = open(self.path, "wb", buffering=0)
        self._written = 0
        self._flushed = 0  # bytes whose writeback was started (write_behind)
        self._write_behind = write_behind and hasattr(os, "posix_fadvise")
        self._write_all(header)

    def _write_all(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            count = self._file.write(view)
            view = view[count:]
            self._written += count
        if self._write_behind and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            os.posix_fadvise(self._file.fileno(), self._flushed, self._written - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._written

    def write(self, data) -> None:
        """Append data bytes (anything exposing the buffer protocol)."""
        if self._written + memoryview(data).nbytes > self.size:
            raise ValueError(f"{self.path}: writing past the {self.size} bytes the header announced")
        self._write_all(data)

    def close(self) -> int:
        if self._file.closed:
            return self.size
        if self._written != self.size:
            self._file.close()
            raise ValueError(f"{self.path}: wrote {self._written} bytes, the header announced {self.size}")
        os.fsync(self._file.fileno())
        self._file.close()
        return self.size

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
