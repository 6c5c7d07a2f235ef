"""Writing a DCP checkpoint as torch 2.13's `FileSystemWriter` does (torch_save serialization),
chunked as FSDP2 shards each tensor at N ranks: dim 0 cut by `torch.chunk`, one
`__<rank>_0.distcp` file per rank, scalars and bytes items (copied byte for byte, never
unpickled) in rank 0's file. Each chunk is its own `torch.save` archive (`torchfile.archive`),
its data copied from the source's byte ranges (`torchfile.rawout`).

`.metadata` is pickled without torch (protocol 2) as exactly the objects `FileSystemWriter`
pickles: `Metadata`, `TensorStorageMetadata`, `ChunkStorageMetadata`, `BytesStorageMetadata`,
`MetadataIndex` (dataclasses: `copyreg.__newobj__` + their `__dict__`), `TensorProperties`
(its `__getstate__` tuple), `_StorageInfo` (its `__dict__` without the None fields),
`torch.Size`, dtypes, `torch.strided` and the contiguous memory format, so `pickle.load` in
torch gives DCP's real classes. The records of every chunk and storage entry (a million at a
large world size) are pickled as `Raw` bytes made as they are written, the globals and keys
they repeat memoized once.
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
from ..core.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..core.names import numel
from ..torchfile.archive import archive_parts
from ..torchfile.pickler import Global, NewObject, Pairs, Raw, Reduce, dumps, pickled_int, pickled_text
from ..torchfile.rawout import RawOutput
from ..torchfile.unpickler import TORCH_DTYPE_NAMES
from .metadata import DCP_FILESYSTEM_MODULE, DCP_METADATA_MODULE, METADATA_NAME, DcpPath, flat_key


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


def write_dcp(
    directory: Path, tensors: list[OutTensor], bytes_items: list[OutBytes], *, world_size: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[str]:
    """Every rank file and `.metadata` in `directory`, not synced (the caller's staged output syncs); the rank files' names."""
    chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {flat_key(t.path): [] for t in tensors}  # (offsets, sizes)
    storage: list[tuple] = []  # key, offsets and chunk index (None for a bytes item), file, offset, length
    copier = ByteEngine(chunk_size=chunk_size)
    try:
        for rank, rank_chunks in enumerate(_chunks_by_rank(tensors, world_size)):
            name = rank_file_name(rank)
            with RawOutput(directory / name, copier) as out:
                for tensor, offsets, sizes in rank_chunks:
                    source, key = tensor.source, flat_key(tensor.path)
                    first = offsets[0] * numel(source.shape[1:]) if offsets else 0
                    wanted = ElementRange(first, first + numel(sizes))
                    head, tail = archive_parts(source.dtype, sizes, wanted.size * dtype_info(source.dtype).itemsize)
                    position = out.position
                    out.write(head)
                    out.copy(source, wanted)
                    out.write(tail)
                    storage.append((key, offsets, len(chunks[key]), name, position, out.position - position))
                    chunks[key].append((offsets, sizes))
                for item in bytes_items if rank == 0 else []:
                    position = out.position
                    out.write(item.read())
                    storage.append((flat_key(item.path), None, None, name, position, out.position - position))
    finally:
        copier.close()
    with open(directory / METADATA_NAME, "wb") as f:
        f.write(_metadata_bytes(tensors, bytes_items, chunks, storage))
        os.fsync(f.fileno())
    return [rank_file_name(rank) for rank in range(world_size)]


def _dcp(name: str) -> Global:
    return Global(DCP_METADATA_MODULE, name)


# The globals and keys every chunk and storage entry repeats: put in pickle's memo once, at
# the start of the stream (pushed, memoized, popped), then fetched by their memo index.
_REPEATED = [
    b"ctorch\nSize\n",
    f"c{DCP_METADATA_MODULE}\nChunkStorageMetadata\n".encode(),
    f"c{DCP_METADATA_MODULE}\nMetadataIndex\n".encode(),
    f"c{DCP_FILESYSTEM_MODULE}\n_StorageInfo\n".encode(),
    *(pickled_text(key) for key in ("offsets", "sizes", "fqn", "relative_path", "offset", "index", "length")),
]
_PRELUDE = b"".join(item + b"q" + bytes([i]) + b"0" for i, item in enumerate(_REPEATED))
_SIZE, _CHUNK_CLS, _INDEX_CLS, _STORAGE_CLS, _OFFSETS, _SIZES, _FQN, _PATH, _OFFSET, _INDEX_KEY, _LENGTH = (
    b"h" + bytes([i]) for i in range(len(_REPEATED))
)
_CHUNK = _CHUNK_CLS + b")\x81}(" + _OFFSETS
_INDEX = _INDEX_CLS + b")\x81}(" + _FQN
_STORAGE = _STORAGE_CLS + b")\x81}(" + _PATH


def _size(values: tuple[int, ...]) -> bytes:
    """`torch.Size(values)`, written directly: the hot path (a million of them at a large world size)."""
    return _SIZE + b"((" + b"".join(map(pickled_int, values)) + b"ttR"


def _tensor_metadata(dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> NewObject:
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_dcp("_MEM_FORMAT_ENCODING"), (0,))
    properties = NewObject(_dcp("TensorProperties"), (Global("torch", TORCH_DTYPE_NAMES[dtype]), layout, False, contiguous, False))
    chunk_list = [Raw(_CHUNK + _size(o) + _SIZES + _size(s) + b"ub") for o, s in chunks]
    return NewObject(_dcp("TensorStorageMetadata"), {"properties": properties, "size": Raw(_size(shape)), "chunks": chunk_list})


def _storage_entry(key: str, offsets: tuple[int, ...] | None, index: int | None, name: str, offset: int, length: int) -> tuple[Raw, Raw]:
    """`MetadataIndex(key, offsets, index)` -> `_StorageInfo(name, offset, length)`."""
    where = _OFFSET + (b"N" if offsets is None else _size(offsets)) + _INDEX_KEY + (b"N" if index is None else pickled_int(index))
    stored = _STORAGE + pickled_text(name) + _OFFSET + pickled_int(offset) + _LENGTH + pickled_int(length) + b"ub"
    return Raw(_INDEX + pickled_text(key) + where + b"ub"), Raw(stored)


def _metadata_bytes(tensors: list[OutTensor], bytes_items: list[OutBytes], chunks: dict, storage: list[tuple]) -> bytes:
    """DCP's `Metadata` as FileSystemWriter's finish pickles it (version 1.0.0, no storage_meta)."""
    tensor_items = ((flat_key(t.path), _tensor_metadata(t.source.dtype, tuple(t.source.shape), chunks[flat_key(t.path)])) for t in tensors)
    byte_items = ((flat_key(b.path), NewObject(_dcp("BytesStorageMetadata"), {})) for b in bytes_items)
    state = {
        "state_dict_metadata": Pairs(itertools.chain(tensor_items, byte_items)),
        "planner_data": {flat_key(t.path): t.path for t in tensors} | {flat_key(b.path): b.path for b in bytes_items},
        "storage_data": Pairs(_storage_entry(*entry) for entry in storage),
        "storage_meta": None,
        "version": "1.0.0",
    }
    return dumps(NewObject(_dcp("Metadata"), state), memo=_PRELUDE)


def torch_saved(value: object) -> bytes:
    """`value` as DCP stores a non-tensor item: torch.save into bytes (the caller's own values)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()
