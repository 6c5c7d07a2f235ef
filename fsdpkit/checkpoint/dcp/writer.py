"""Writing a DCP checkpoint as torch 2.13's `FileSystemWriter` does (torch_save serialization),
chunked as FSDP2 shards each tensor at N ranks: dim 0 cut by `torch.chunk` (ceil(rows / N)
rows per rank, the last ranks fewer or none), one `__<rank>_0.distcp` file per rank, scalars
and bytes items in rank 0's file, then `.metadata`.

Each chunk is its own `torch.save` archive (`archive.py`, what DCP's reader `torch.load`s):
the archive's head, the chunk's bytes copied from the source's byte ranges (`rawout`: the
kernel copies large ones from file to file), its tail. Bytes items are copied byte for byte,
never unpickled. `.metadata` is DCP's own classes pickled without torch (`pickler`).
"""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..format.names import numel
from ..torchfile.archive import archive_parts
from ..torchfile.rawout import RawOutput
from . import pickler
from .metadata import METADATA_NAME, DcpPath, flat_key


@dataclass(frozen=True)
class OutTensor:
    path: DcpPath
    source: SourceTensor


@dataclass(frozen=True)
class OutBytes:
    path: DcpPath
    read: Callable[[], bytes]  # the item's raw bytes, as stored


def dim0_chunks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) rows of each rank, as `torch.chunk(tensor, world_size, dim=0)` (FSDP2)."""
    size = -(-rows // world_size) if rows else 0
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world_size)]


def rank_file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


@dataclass
class _Written:
    """What the rank files hold: each tensor's chunks (offsets, sizes) and where every item sits."""

    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]
    storage: list[tuple[str, tuple[int, ...] | None, int, str, int, int]]  # key, offsets, index, file, offset, length


def _chunks_by_rank(tensors: list[OutTensor], world_size: int) -> list[list[tuple[OutTensor, tuple[int, ...], tuple[int, ...]]]]:
    """(tensor, offsets, sizes) of every chunk, per rank, in the tensors' order."""
    by_rank: list[list] = [[] for _ in range(world_size)]
    for tensor in tensors:
        shape = tuple(tensor.source.shape)
        if not shape:
            by_rank[0].append((tensor, (), ()))
            continue
        for rank, (start, end) in enumerate(dim0_chunks(shape[0], world_size)):
            if start < end:
                by_rank[rank].append((tensor, (start, *[0] * (len(shape) - 1)), (end - start, *shape[1:])))
    return by_rank


def _write_rank_file(out: RawOutput, chunks: list, name: str, written: _Written) -> None:
    for tensor, offsets, sizes in chunks:
        source, key = tensor.source, flat_key(tensor.path)
        first = offsets[0] * numel(source.shape[1:]) if offsets else 0
        wanted = ElementRange(first, first + numel(sizes))
        head, tail = archive_parts(source.dtype, sizes, wanted.size * dtype_info(source.dtype).itemsize)
        position = out.position
        out.write(head)
        out.copy(source, wanted)
        out.write(tail)
        written.storage.append((key, offsets, len(written.chunks[key]), name, position, out.position - position))
        written.chunks[key].append((offsets, sizes))


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
    syncs); returns the rank files' names (as a sharded checkpoint's do, not counting its metadata)."""
    written = _Written({flat_key(t.path): [] for t in tensors}, [])
    copier = ByteEngine(chunk_size=chunk_size)
    try:
        for rank, chunks in enumerate(_chunks_by_rank(tensors, world_size)):
            name = rank_file_name(rank)
            with RawOutput(directory / name, copier, progress) as out:
                _write_rank_file(out, chunks, name, written)
                if rank == 0:
                    for item in bytes_items:
                        position = out.position
                        out.write(item.read())
                        written.storage.append((flat_key(item.path), None, 0, name, position, out.position - position))
    finally:
        copier.close()
    with open(directory / METADATA_NAME, "wb") as f:
        f.write(_metadata_bytes(tensors, bytes_items, written))
        os.fsync(f.fileno())
    return [rank_file_name(rank) for rank in range(world_size)]


def _metadata_bytes(tensors: list[OutTensor], bytes_items: list[OutBytes], written: _Written) -> bytes:
    """DCP's `Metadata` as FileSystemWriter pickles it (without torch: `pickler`)."""
    tensor_items = (
        (flat_key(t.path), pickler.tensor_metadata(t.source.dtype, tuple(t.source.shape), written.chunks[flat_key(t.path)]))
        for t in tensors
    )
    byte_items = ((flat_key(b.path), pickler.bytes_metadata()) for b in bytes_items)
    storage = (
        (pickler.metadata_index(key, offsets, index if offsets is not None else None), pickler.storage_info(name, offset, length))
        for key, offsets, index, name, offset, length in written.storage
    )
    planner_data = {flat_key(t.path): t.path for t in tensors} | {flat_key(b.path): b.path for b in bytes_items}
    return pickler.metadata(itertools.chain(tensor_items, byte_items), planner_data, storage)


def torch_saved(value: object) -> bytes:
    """`value` as DCP stores a non-tensor item: torch.save into bytes (the caller's own values)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
