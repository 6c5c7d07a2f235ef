"""Writing a DCP checkpoint as torch 2.13's `FileSystemWriter` does (torch_save serialization),
chunked as FSDP2 shards each tensor at N ranks: dim 0 cut by `torch.chunk` (ceil(rows / N)
rows per rank, the last ranks fewer or none), one `__<rank>_0.distcp` file per rank, scalars
and bytes items in rank 0's file, then `.metadata` (DCP's own classes, pickled).

Each chunk is read through the byte copier into one buffer and written as its own
`torch.save` archive (`archive.py`, what DCP's reader `torch.load`s), so memory is one chunk.
Bytes items are copied byte for byte, never unpickled. Only `.metadata` needs torch (DCP's own
classes, pickled); it is imported when it is written.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..checkpoint.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..checkpoint.format import numel
from ..dtypes import dtype_info
from ..layout import ElementRange
from .archive import archive_parts
from .metadata import METADATA_NAME

DcpPath = tuple[str | int, ...]


@dataclass(frozen=True)
class OutTensor:
    path: DcpPath  # where it sits in the nested state dict, e.g. ("model", "wte.weight")
    source: SourceTensor


@dataclass(frozen=True)
class OutBytes:
    path: DcpPath
    read: Callable[[], bytes]  # the item's raw bytes, as stored


def flat_key(path: DcpPath) -> str:
    return ".".join(str(part) for part in path)


def dim0_chunks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) rows of each rank, as `torch.chunk(tensor, world_size, dim=0)` (FSDP2)."""
    size = -(-rows // world_size) if rows else 0
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world_size)]


def rank_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def _chunk_bytes(copier: ByteEngine, source: SourceTensor, wanted: ElementRange) -> bytearray:
    """Elements `wanted` of `source`, read straight into a new buffer."""
    data = bytearray(wanted.size * source.nbytes // max(source.numel, 1))
    copier.read_into(source, wanted, memoryview(data))
    return data


def rank_chunk(shape: tuple[int, ...], rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of rank `rank`'s chunk of a tensor of `shape`; None when it holds none
    (scalars live on rank 0)."""
    if not shape:
        return ((), ()) if rank == 0 else None
    start, end = dim0_chunks(shape[0], world_size)[rank]
    if start == end:
        return None
    return (start, *[0] * (len(shape) - 1)), (end - start, *shape[1:])


@dataclass
class _Written:
    """What the rank files hold: each tensor's chunks (offsets, sizes) and where every item sits."""

    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    storage: list[tuple[str, tuple[int, ...] | None, int, str, int, int]]  # key, offsets, index, file, offset, length


def _write_rank_file(stream: BinaryIO, rank: int, world_size: int, tensors: list[OutTensor], copier: ByteEngine, written: _Written) -> None:
    name = rank_file_name(rank)
    for tensor in tensors:
        source, key = tensor.source, flat_key(tensor.path)
        chunk = rank_chunk(tuple(source.shape), rank, world_size)
        if chunk is None:
            continue
        offsets, sizes = chunk
        first = offsets[0] * numel(source.shape[1:]) if offsets else 0
        raw = _chunk_bytes(copier, source, ElementRange(first, first + numel(sizes)))
        head, tail = archive_parts(source.dtype, sizes, zlib.crc32(raw), len(raw))
        position = stream.tell()
        stream.write(head)
        stream.write(raw)
        stream.write(tail)
        written.storage.append((key, offsets, len(written.chunks[key]), name, position, stream.tell() - position))
        written.chunks[key].append(chunk)


def write_dcp(
    directory: Path,
    tensors: list[OutTensor],
    bytes_items: list[OutBytes],
    *,
    world_size: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Every rank file and `.metadata` in `directory` (not synced: the caller's staged output
    syncs); returns the file names."""
    written = _Written({flat_key(t.path): [] for t in tensors}, [])
    copier = ByteEngine(chunk_size=chunk_size, progress=progress)
    try:
        for rank in range(world_size):
            with open(directory / rank_file_name(rank), "wb") as stream:
                _write_rank_file(stream, rank, world_size, tensors, copier, written)
                if rank == 0:
                    for item in bytes_items:
                        position = stream.tell()
                        stream.write(item.read())
                        written.storage.append((flat_key(item.path), None, 0, rank_file_name(0), position, stream.tell() - position))
    finally:
        copier.close()
    with open(directory / METADATA_NAME, "wb") as f:
        f.write(_metadata_bytes(tensors, bytes_items, written))
        os.fsync(f.fileno())
    return [*(rank_file_name(rank) for rank in range(world_size)), METADATA_NAME]


def _metadata_bytes(tensors: list[OutTensor], bytes_items: list[OutBytes], written: _Written) -> bytes:
    """DCP's `Metadata`, built from DCP's own classes and pickled as FileSystemWriter does."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    items: dict = {}
    for tensor in tensors:
        key = flat_key(tensor.path)
        chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in written.chunks[key]]
        properties = TensorProperties(dtype=dtype_info(tensor.source.dtype).torch)
        items[key] = TensorStorageMetadata(properties, torch.Size(tensor.source.shape), chunks)
    for item in bytes_items:
        items[flat_key(item.path)] = BytesStorageMetadata()
    storage = {
        MetadataIndex(key, offsets, index) if offsets is not None else MetadataIndex(key): _StorageInfo(name, offset, length)
        for key, offsets, index, name, offset, length in written.storage
    }
    planner_data = {flat_key(t.path): t.path for t in tensors} | {flat_key(b.path): b.path for b in bytes_items}
    buffer = io.BytesIO()
    pickle.dump(Metadata(items, planner_data=planner_data, storage_data=storage, version="1.0.0"), buffer)
    return buffer.getvalue()


def torch_saved(value: object) -> bytes:
    """`value` as DCP stores a non-tensor item: torch.save into bytes (the caller's own values)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
