"""A DCP checkpoint as a table of tensors whose elements lie at byte ranges of its files (no
torch): what inspect, verify, convert, reshard and diff read. `open_dcp` checks that every file
is a regular file inside the directory holding its byte ranges, and that each tensor's chunks
cover it exactly once; a chunk's data is located (`chunkdata`) when first read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..format.bytecopy import SourcePiece, SourceTensor
from ..format.files import open_regular, read_exactly
from ..format.names import Header
from ..format.storage import checkpoint_file
from ..torchfile.savefile import ZIP_MAGIC
from . import chunkdata
from .boxes import coverage_problem, flat_runs
from .metadata import METADATA_NAME, Chunk, DcpMetadata, DcpTensor, Location, read_metadata


class DcpCheckpoint:
    def __init__(self, metadata: DcpMetadata):
        self.metadata = metadata
        self.directory = metadata.directory
        self._files: dict[str, tuple[int, int]] = {}  # name -> (fd, size)
        self._blobs: dict[tuple[str, int], tuple[Header, dict]] = {}
        self._data: dict[tuple[str, tuple[int, ...]], chunkdata.ChunkData] = {}

    def file(self, name: str) -> tuple[int, int]:
        """(fd, size) of a data file, opened once (a regular file inside the directory)."""
        if name not in self._files:
            self._files[name] = open_regular(checkpoint_file(self.directory, name))
        return self._files[name]

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1][0])

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
            return [f"{self.directory / location.file}: item {key!r} spans bytes up to {end}, the file has {size} (truncated)"]
        return []

    def chunk_data(self, tensor: DcpTensor, chunk: Chunk) -> chunkdata.ChunkData:
        """Where the chunk's raw bytes lie (parsed once, checked against the metadata)."""
        cache_key = (tensor.key, chunk.offsets)
        found = self._data.get(cache_key)
        if found is None:
            found = self._data[cache_key] = self._locate(tensor, chunk)
        return found

    def _locate(self, tensor: DcpTensor, chunk: Chunk) -> chunkdata.ChunkData:
        location = chunk.location
        fd, size = self.file(location.file)
        path = self.directory / location.file
        if location.offset + location.length > size:
            raise DataCheckError(
                f"{path}: chunk of {tensor.key!r} ends at byte {location.offset + location.length}, the file at {size} (truncated)"
            )
        magic = read_exactly(fd, min(len(ZIP_MAGIC), location.length), location.offset, path)
        if magic == ZIP_MAGIC:
            return chunkdata.torch_save_data(
                fd, path, location.offset, location.length, key=tensor.key, dtype=tensor.dtype, shape=chunk.sizes
            )
        blob = self._blobs.get((location.file, location.offset))
        if blob is None:
            blob = self._blobs[(location.file, location.offset)] = chunkdata.safetensors_blob(fd, path, location.offset, size)
        return chunkdata.safetensors_data(
            path, location.offset, blob, key=tensor.key, dtype=tensor.dtype, shape=chunk.sizes, offsets=chunk.offsets
        )

    def read_bytes_item(self, key: str) -> bytes:
        """The raw bytes of bytes item `key` (a `torch.save` archive; nothing is unpickled here)."""
        item = self.metadata.bytes_items.get(key)
        if item is None:
            raise UsageError(f"{self.directory}: no bytes item {key!r}")
        fd, _ = self.file(item.location.file)
        return read_exactly(fd, item.location.length, item.location.offset, self.directory / item.location.file)

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
        itemsize = dtype_info(tensor.dtype).itemsize
        pieces = []
        for chunk in tensor.chunks:
            data = self.chunk_data(tensor, chunk)
            path = self.directory / chunk.location.file
            for first, count, within in flat_runs(tensor.shape, chunk.offsets, chunk.sizes):
                pieces.append(
                    SourcePiece(ElementRange(first, first + count), path, data.offset + within * itemsize, count * itemsize, None, name)
                )
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


def open_dcp(path: str | os.PathLike[str]) -> DcpCheckpoint:
    """A DCP checkpoint with its metadata, files and chunk coverage checked (DataCheckError)."""
    path = Path(path)
    if not (path / METADATA_NAME).exists():
        raise DataCheckError(f"{path}: not a DCP checkpoint (no {METADATA_NAME})")
    checkpoint = DcpCheckpoint(read_metadata(path))
    problems = checkpoint.structure_problems()
    if problems:
        checkpoint.close()
        more = f" (and {len(problems) - 1} more problems; run fsdpkit verify)" if len(problems) > 1 else ""
        raise DataCheckError(problems[0] + more)
    return checkpoint
