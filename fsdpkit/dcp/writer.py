"""Writing a DCP checkpoint as torch 2.13's `FileSystemWriter` does (torch_save serialization),
chunked as FSDP2 shards each tensor at N ranks: dim 0 cut by `torch.chunk` (ceil(rows / N)
rows per rank, the last ranks fewer or none), one `__<rank>_0.distcp` file per rank, scalars
and bytes items in rank 0's file, then `.metadata` (DCP's own classes, pickled).

Each chunk is read through the byte copier into one buffer and written as its own
`torch.save` archive (what DCP's reader `torch.load`s), so memory is one chunk. Bytes items
are copied byte for byte, never unpickled. This module imports torch (for `torch.save` and
DCP's metadata classes), when a writer runs.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.bytecopy import DEFAULT_CHUNK_SIZE, ByteCopier, SourceTensor
from ..checkpoint.format import numel
from ..layout import ElementRange
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


def _chunk_bytes(copier: ByteCopier, source: SourceTensor, wanted: ElementRange) -> bytearray:
    data = bytearray(wanted.size * source.nbytes // max(source.numel, 1))
    filled = 0

    def collect(view: memoryview) -> None:
        nonlocal filled
        data[filled : filled + view.nbytes] = view
        filled += view.nbytes

    copier.copy(source, wanted, source.dtype, collect)
    return data


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

    from ..checkpoint.state import SAFETENSORS_TO_TORCH

    chunks: dict[str, list] = {flat_key(t.path): [] for t in tensors}
    storage: dict = {}
    copier = ByteCopier(chunk_size=chunk_size, progress=progress)
    names = []
    try:
        for rank in range(world_size):
            name = rank_file_name(rank)
            names.append(name)
            with open(directory / name, "wb") as stream:
                for tensor in tensors:
                    source, key = tensor.source, flat_key(tensor.path)
                    offsets: tuple[int, ...]
                    sizes: tuple[int, ...]
                    if not source.shape:
                        if rank != 0:
                            continue
                        offsets, sizes = (), ()
                    else:
                        start, end = dim0_chunks(source.shape[0], world_size)[rank]
                        if start == end:
                            continue
                        offsets, sizes = (start, *[0] * (len(source.shape) - 1)), (end - start, *source.shape[1:])
                    row = numel(source.shape[1:]) if source.shape else 1
                    first = offsets[0] * row if offsets else 0
                    raw = _chunk_bytes(copier, source, ElementRange(first, first + numel(sizes)))
                    value = torch.frombuffer(raw, dtype=SAFETENSORS_TO_TORCH[source.dtype]) if raw else torch.empty(0)
                    position = stream.tell()
                    torch.save(value.reshape(sizes), stream)
                    index = len(chunks[key])
                    chunks[key].append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                    storage[MetadataIndex(key, offsets, index)] = _StorageInfo(name, position, stream.tell() - position)
                if rank == 0:
                    for item in bytes_items:
                        position = stream.tell()
                        stream.write(item.read())
                        storage[MetadataIndex(flat_key(item.path))] = _StorageInfo(name, position, stream.tell() - position)
    finally:
        copier.close()
    state_dict_metadata: dict = {}
    for tensor in tensors:
        properties = TensorProperties(dtype=SAFETENSORS_TO_TORCH[tensor.source.dtype])
        key = flat_key(tensor.path)
        state_dict_metadata[key] = TensorStorageMetadata(properties, torch.Size(tensor.source.shape), chunks[key])
    for item in bytes_items:
        state_dict_metadata[flat_key(item.path)] = BytesStorageMetadata()
    planner_data = {flat_key(t.path): t.path for t in tensors} | {flat_key(b.path): b.path for b in bytes_items}
    metadata = Metadata(state_dict_metadata, planner_data=planner_data, storage_data=storage, version="1.0.0")
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    with open(directory / METADATA_NAME, "wb") as f:
        f.write(buffer.getvalue())
        os.fsync(f.fileno())
    return [*names, METADATA_NAME]


def torch_saved(value: object) -> bytes:
    """`value` as DCP stores a non-tensor item: torch.save into bytes (the caller's own values)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
