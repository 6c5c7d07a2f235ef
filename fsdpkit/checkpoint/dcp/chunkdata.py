"""Where a DCP chunk's raw tensor bytes lie inside its `.distcp` file (no torch).

`torch_save` serialization: each chunk is a whole `torch.save` archive at its byte range, a
zip of stored (uncompressed) records: `<name>/data.pkl` (a pickle of the tensor record: its
storage, offset, shape, stride, dtype), `<name>/byteorder`, `<name>/data/<key>` (the
storage's bytes). The pickle is read with the allow-list unpickler (only
`_rebuild_tensor_v2/v3`, storage classes, dtypes, OrderedDict); the record must be a
contiguous little-endian tensor of the chunk's shape and dtype inside its storage (a view at
a storage offset is read from there; a non-contiguous one is refused, naming the chunk), and
its bytes are then a plain byte range of the file. Small records are read through their zip
local headers, not zipfile: torch.save with crc32 off writes 0 crc32s, which zipfile refuses.

`safetensors` serialization: each file is the rank's bytes items followed by one
safetensors blob of its chunks (named by the flattened key, their offsets in the blob's
`DCP_SHARDING_INFO` metadata); every chunk's storage entry points at the blob's start.
"""

from __future__ import annotations

import io
import json
import os
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ..format.files import read_exactly
from ..format.names import MAX_HEADER_BYTES, Header, numel, parse_header_bytes
from . import unpickler as u

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes
SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
TORCH_SAVE, SAFETENSORS = "torch_save", "safetensors"


@dataclass(frozen=True)
class ChunkData:
    offset: int  # absolute offset of the chunk's first data byte in its file
    nbytes: int
    serialization: str


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable read-only file."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        count = max(0, min(len(buffer), self._length - self._position))
        data = os.pread(self._fd, count, self._start + self._position) if count else b""
        buffer[: len(data)] = data
        self._position += len(data)
        return len(data)


def torch_save_data(fd: int, path: Path, start: int, length: int, *, key: str, dtype: str, shape: tuple[int, ...]) -> ChunkData:
    """The data range of the `torch.save` archive at [start, start + length) of `path`, checked
    against the chunk's dtype and shape."""
    where = f"{path}: chunk of {key!r} at byte {start}"
    try:
        archive = zipfile.ZipFile(_Window(fd, start, length))
        names = archive.namelist()
        pickles = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise DataCheckError(f"{where}: not a torch.save archive (no data.pkl)")
        prefix = pickles[0][: -len("data.pkl")]
        if f"{prefix}byteorder" in names and _record(fd, path, start, length, archive.getinfo(f"{prefix}byteorder"), where) != b"little":
            raise DataCheckError(f"{where}: big-endian data is not supported")
        raw = _record(fd, path, start, length, archive.getinfo(pickles[0]), where)
        record = u.restricted_loads(raw, allowed=u.TENSOR_GLOBALS, where=f"{where} data.pkl", storages=True)
        if not isinstance(record, u.TensorRecord):
            raise DataCheckError(f"{where}: holds a {type(record).__name__}, not a tensor")
        info = archive.getinfo(f"{prefix}data/{record.storage.key}")
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError) as error:
        raise DataCheckError(f"{where}: not a readable torch.save archive ({str(error)[:100]})") from None
    skip = _check_record(where, record, dtype, shape, info.file_size)
    nbytes = numel(shape) * dtype_info(dtype).itemsize
    return ChunkData(start + _data_start(fd, path, start, length, info, where) + skip, nbytes, TORCH_SAVE)


def _data_start(fd: int, path: Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> int:
    """Where the stored record `info` starts inside the archive (its local header read)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise DataCheckError(f"{where}: record {info.filename} is compressed")
    header = read_exactly(fd, LOCAL_HEADER.size, start + info.header_offset, path)
    magic, *_, name_length, extra_length = LOCAL_HEADER.unpack(header)
    if magic != ZIP_MAGIC:
        raise DataCheckError(f"{where}: the header of record {info.filename} is damaged")
    data_start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
    if data_start + info.file_size > length:
        raise DataCheckError(f"{where}: record {info.filename} ends past the chunk's {length} bytes")
    return data_start


def _record(fd: int, path: Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> bytes:
    """A small stored record's bytes, read directly: torch.save with crc32 off writes 0 for
    every record's crc32, which zipfile would refuse."""
    return read_exactly(fd, info.file_size, start + _data_start(fd, path, start, length, info, where), path)


def _check_record(where: str, record: u.TensorRecord, dtype: str, shape: tuple[int, ...], stored: int) -> int:
    """The bytes before the tensor's data in its storage (a contiguous view at an offset);
    anything else than a contiguous little-endian tensor inside its storage is refused."""
    found = record.dtype or record.storage.storage_type.dtype
    if found != dtype:
        raise DataCheckError(f"{where}: holds {found}, the metadata says {dtype}")
    if record.shape != shape:
        raise DataCheckError(f"{where}: holds shape {list(record.shape)}, the metadata says {list(shape)}")
    expected_stride, step = [], 1
    for dim in reversed(shape):
        expected_stride.append(step)
        step *= dim
    if numel(shape) > 1 and tuple(s for s, d in zip(record.stride, shape, strict=True) if d > 1) != tuple(
        s for s, d in zip(reversed(expected_stride), shape, strict=True) if d > 1
    ):
        raise DataCheckError(f"{where}: tensor is not contiguous (stride {list(record.stride)}), which fsdpkit does not read")
    itemsize = dtype_info(dtype).itemsize
    skip, nbytes = record.storage_offset * itemsize, numel(shape) * itemsize
    if record.storage_offset < 0 or skip + nbytes > stored:
        raise DataCheckError(f"{where}: {nbytes} bytes at element {record.storage_offset} of a storage of {stored} bytes (outside it)")
    return skip


def safetensors_blob(fd: int, path: Path, start: int, size: int) -> tuple[Header, dict]:
    """The header of the safetensors blob at byte `start` of `path`, and its sharding info."""
    prefix = read_exactly(fd, 8, start, path) if start + 8 <= size else b""
    if len(prefix) < 8:
        raise DataCheckError(f"{path}: no safetensors header at byte {start} (truncated)")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_HEADER_BYTES or start + 8 + header_len > size:
        raise DataCheckError(f"{path}: safetensors header at byte {start} claims {header_len} bytes (truncated or not safetensors)")
    header = parse_header_bytes(read_exactly(fd, header_len, start + 8, path), path=path)
    if start + header.file_size > size:
        raise DataCheckError(f"{path}: safetensors data at byte {start} ends at {start + header.file_size}, the file at {size} (truncated)")
    try:
        sharding = json.loads(header.metadata.get(SHARDING_INFO_KEY, "{}"))
    except ValueError:
        raise DataCheckError(f"{path}: {SHARDING_INFO_KEY} is not JSON") from None
    return header, sharding if isinstance(sharding, dict) else {}


def safetensors_data(
    path: Path, start: int, blob: tuple[Header, dict], *, key: str, dtype: str, shape: tuple[int, ...], offsets: tuple[int, ...]
) -> ChunkData:
    header, sharding = blob
    info = header.tensors.get(key)
    where = f"{path}: chunk of {key!r}"
    if info is None:
        raise DataCheckError(f"{where} is missing from the safetensors data at byte {start}")
    if info.dtype != dtype or info.shape != shape:
        raise DataCheckError(f"{where}: holds {info.dtype}{list(info.shape)}, the metadata says {dtype}{list(shape)}")
    saved = (sharding.get(key) or {}).get("saved_offsets")
    if saved is not None and tuple(saved) != offsets:
        raise DataCheckError(f"{where}: the file holds the chunk at {saved}, the metadata at {list(offsets)}")
    return ChunkData(start + header.data_start + info.begin, info.nbytes, SAFETENSORS)
