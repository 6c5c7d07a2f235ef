"""A DCP checkpoint as a table of tensors whose elements lie at byte ranges of its files (no
torch): what inspect, verify, convert, reshard and diff read. `open_dcp` checks that every file
is a regular file inside the directory holding its byte ranges, and that each tensor's chunks
cover it exactly once; a chunk's data is located when first read.

`torch_save` serialization: each chunk is a whole `torch.save` archive (`torchfile.savefile`)
at its byte range. Its data.pkl, read with the allow-list unpickler, must be a contiguous
little-endian tensor of the chunk's shape and dtype inside its storage (a view at a storage
offset is read from there; a non-contiguous one is refused, naming the chunk); its bytes are
then a plain byte range of the file.

`safetensors` serialization: each file is the rank's bytes items followed by one
safetensors blob of its chunks (named by the flattened key, their offsets in the blob's
`DCP_SHARDING_INFO` metadata); every chunk's storage entry points at the blob's start.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..core.boxes import coverage_problem, flat_runs
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.files import Descriptor, open_regular, read_exactly, source_path
from ..core.names import MAX_HEADER_BYTES, Header, numel, parse_header_bytes
from ..core.staging import checkpoint_file
from ..storage.face import Storage
from ..storage.handle import open_handle
from ..torchfile import unpickler as u
from ..torchfile.savefile import ZIP_MAGIC, TensorRange, record_start, tensor_bytes, torch_save_pickle
from .metadata import METADATA_GLOBALS, METADATA_NAME, Chunk, DcpMetadata, DcpTensor, Location, read_metadata

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
TORCH_SAVE, SAFETENSORS = "torch_save", "safetensors"


@dataclass(frozen=True)
class ChunkData:
    offset: int  # absolute offset of the chunk's first data byte in its file
    nbytes: int
    serialization: str


def torch_save_data(
    fd: Descriptor, path: str | Path, start: int, length: int, *, key: str, dtype: str, shape: tuple[int, ...]
) -> ChunkData:
    """The data range of the `torch.save` archive at byte `start`, checked against the chunk's dtype and shape."""
    where = f"{path}: chunk of {key!r} at byte {start}"
    try:
        archive, prefix, raw = torch_save_pickle(fd, path, start, length, where)
        record = u.restricted_loads(raw, allowed=u.TENSOR_GLOBALS, where=f"{where} data.pkl", storages=True)
        if not isinstance(record, u.TensorRecord):
            raise DataCheckError(f"{where}: holds a {type(record).__name__}, not a tensor")
        info = archive.getinfo(f"{prefix}data/{record.storage.key}")
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError) as error:
        raise DataCheckError(f"{where}: not a readable torch.save archive ({str(error)[:100]})") from None
    found = record.dtype or record.storage.storage_type.dtype
    if found != dtype:
        raise DataCheckError(f"{where}: holds {found}, the metadata says {dtype}")
    if record.shape != shape:
        raise DataCheckError(f"{where}: holds shape {list(record.shape)}, the metadata says {list(shape)}")
    _, skip, nbytes = tensor_bytes(record, info.file_size, where)
    return ChunkData(start + record_start(fd, path, start, length, info, where) + skip, nbytes, TORCH_SAVE)


def safetensors_blob(fd: Descriptor, path: str | Path, start: int, size: int) -> tuple[Header, dict]:
    """The header of the safetensors blob at byte `start` of `path`, and its sharding info."""
    if start + 8 > size:
        raise DataCheckError(f"{path}: no safetensors header at byte {start} (truncated)")
    (header_len,) = struct.unpack("<Q", read_exactly(fd, 8, start, path))
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


def safetensors_data(path: str | Path, start: int, blob: tuple[Header, dict], tensor: DcpTensor, chunk: Chunk) -> ChunkData:
    header, sharding = blob
    key, dtype, shape, offsets = tensor.key, tensor.dtype, chunk.sizes, chunk.offsets
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


class DcpCheckpoint:
    def __init__(self, metadata: DcpMetadata, storage: Storage | None = None, *, root: Path | None = None):
        """The checkpoint `metadata` describes, its files in a local directory (`root`, a
        `StoredPath` for a bucket read in place), or in `storage` (read through the face)."""
        self.metadata = metadata
        self.directory = metadata.directory
        self._root = root if root is not None else Path(metadata.directory)
        self._storage = storage
        self._files: dict[str, tuple[Descriptor, int]] = {}  # name -> (fd or object handle, size)
        self._blobs: dict[tuple[str, int], tuple[Header, dict]] = {}
        self._data: dict[tuple[str, tuple[int, ...]], ChunkData] = {}

    def file(self, name: str) -> tuple[Descriptor, int]:
        """(fd, size) of a data file, opened once (a regular file inside the directory), or
        (handle, size) of an object in the storage."""
        if name not in self._files:
            if self._storage is None:
                self._files[name] = open_regular(checkpoint_file(self._root, name))
            else:
                self._files[name] = open_handle(self._storage, name)
        return self._files[name]

    def where(self, name: str) -> str:
        """The path or URL of file `name`, for messages."""
        return self._storage.where(name) if self._storage is not None else str(self._root / name)

    def close(self) -> None:
        while self._files:
            fd = self._files.popitem()[1][0]
            if isinstance(fd, int):
                os.close(fd)

    def __enter__(self) -> DcpCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def structure_problems(self) -> list[str]:
        """Files missing or too short for the byte ranges named, and chunk coverage: one line each."""
        problems = []
        for name in self.metadata.files:
            try:
                self.file(name)
            except DataCheckError as error:
                problems.append(str(error))
        for tensor in self.metadata.tensors.values():
            for chunk in tensor.chunks:
                problems.extend(self._range_problem(tensor.key, chunk.location))
            problem = coverage_problem(tensor.shape, [(c.offsets, c.sizes) for c in tensor.chunks])
            if problem is not None:
                problems.append(f"{self.directory}: tensor {tensor.key!r} {list(tensor.shape)}: {problem}")
        for item in self.metadata.bytes_items.values():
            problems.extend(self._range_problem(item.key, item.location))
        return problems

    def opened(self, name: str) -> bool:
        return name in self._files

    def _range_problem(self, key: str, location: Location) -> list[str]:
        if location.file not in self._files:
            return []  # already reported missing
        size, end = self._files[location.file][1], location.offset + location.length
        if end > size:
            return [f"{self.where(location.file)}: item {key!r} spans bytes up to {end}, the file has {size} (truncated)"]
        return []

    def chunk_data(self, tensor: DcpTensor, chunk: Chunk) -> ChunkData:
        """Where the chunk's raw bytes lie (parsed once, checked against the metadata)."""
        cache_key = (tensor.key, chunk.offsets)
        found = self._data.get(cache_key)
        if found is None:
            found = self._data[cache_key] = self._locate(tensor, chunk)
        return found

    def _locate(self, tensor: DcpTensor, chunk: Chunk) -> ChunkData:
        location = chunk.location
        fd, size = self.file(location.file)
        path = self.where(location.file)
        end = location.offset + location.length
        if end > size:
            raise DataCheckError(f"{path}: chunk of {tensor.key!r} ends at byte {end}, the file at {size} (truncated)")
        magic = read_exactly(fd, min(len(ZIP_MAGIC), location.length), location.offset, path)
        if magic == ZIP_MAGIC:
            return torch_save_data(fd, path, location.offset, location.length, key=tensor.key, dtype=tensor.dtype, shape=chunk.sizes)
        blob = self._blobs.get((location.file, location.offset))
        if blob is None:
            blob = self._blobs[(location.file, location.offset)] = safetensors_blob(fd, path, location.offset, size)
        return safetensors_data(path, location.offset, blob, tensor, chunk)

    def read_bytes_item(self, key: str) -> bytes:
        """The raw bytes of bytes item `key` (a `torch.save` archive; nothing is unpickled here)."""
        item = self.metadata.bytes_items.get(key)
        if item is None:
            raise UsageError(f"{self.directory}: no bytes item {key!r}")
        fd, _ = self.file(item.location.file)
        return read_exactly(fd, item.location.length, item.location.offset, self.where(item.location.file))

    @property
    def serializations(self) -> list[str]:
        """The serializations of the chunks located so far."""
        return sorted({data.serialization for data in self._data.values()})

    def source(self, key: str, name: str | None = None) -> SourceTensor:
        tensor = self.metadata.tensors.get(key)
        if tensor is None:
            raise UsageError(f"{self.directory}: no tensor {key!r}")
        return DcpSource(name or key, tensor.shape, tensor.dtype, self, tensor)

    def pieces(self, tensor: DcpTensor, name: str) -> tuple[SourcePiece, ...]:
        pieces = []
        for chunk in tensor.chunks:
            offset = self.chunk_data(tensor, chunk).offset
            data = TensorRange(self._root / chunk.location.file, offset, numel(chunk.sizes), tensor.dtype)
            for first, count, within in flat_runs(tensor.shape, chunk.offsets, chunk.sizes):
                pieces.append(data.piece(name, within, count, first))
        pieces.sort(key=lambda piece: piece.range.start)
        return tuple(pieces)


class DcpSource(SourceTensor):
    """A DCP tensor; its pieces are located when first asked for."""

    _pieces: Callable[[], tuple[SourcePiece, ...]]  # set through object.__setattr__: SourceTensor is frozen

    def __init__(self, name: str, shape: tuple[int, ...], dtype: str, checkpoint: DcpCheckpoint, tensor: DcpTensor):
        super().__init__(name, shape, dtype)
        object.__setattr__(self, "_pieces", functools.cache(functools.partial(checkpoint.pieces, tensor, name)))

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        return [p for p in self._pieces() if p.range.start < wanted.end and wanted.start < p.range.end]


def open_dcp(path: str | os.PathLike[str], allowed: Mapping[tuple[str, str], Any] = METADATA_GLOBALS) -> DcpCheckpoint:
    """A DCP checkpoint with its metadata, files and chunk coverage checked (DataCheckError);
    `allowed`: its metadata's allow-list."""
    path = source_path(path)
    if not (path / METADATA_NAME).exists():
        raise DataCheckError(f"{path}: not a DCP checkpoint (no {METADATA_NAME})")
    checkpoint = DcpCheckpoint(read_metadata(path, allowed), root=path)
    problems = checkpoint.structure_problems()
    if problems:
        checkpoint.close()
        more = f" (and {len(problems) - 1} more problems; run fsdpkit verify)" if len(problems) > 1 else ""
        raise DataCheckError(problems[0] + more)
    return checkpoint
