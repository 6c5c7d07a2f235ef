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
from ..core.crc import check_parts
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


@dataclass(frozen=True)
class DcpChunk:
    """Rows `offsets[0]` on of `tensor` (`sizes` elements per dimension): one `torch.save` archive."""

    tensor: OutTensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def wanted(self) -> ElementRange:
        source = self.tensor.source
        first = self.offsets[0] * numel(source.shape[1:]) if self.offsets else 0
        return ElementRange(first, first + numel(self.sizes))

    def archive(self) -> tuple[bytes, bytes]:
        """The archive's bytes before and after the chunk's data."""
        source = self.tensor.source
        return archive_parts(source.dtype, self.sizes, self.wanted.size * dtype_info(source.dtype).itemsize)


@dataclass(frozen=True)
class DcpRecord:
    """What lies at bytes [position, position + length) of a rank file: a chunk's archive (its
    data at [data_begin, data_end)) or a bytes item (`item`, copied as stored)."""

    key: str
    position: int
    length: int
    chunk: DcpChunk | None = None
    index: int | None = None  # the chunk's index among its tensor's chunks
    item: bytes | None = None
    data_begin: int = 0
    data_end: int = 0


@dataclass(frozen=True)
class DcpPlan:
    """Every rank file of a DCP output, record by record, before any is written (no data read)."""

    tensors: list[OutTensor]
    items: list[tuple[DcpPath, bytes]]
    ranks: list[list[DcpRecord]]

    def file_size(self, rank: int) -> int:
        records = self.ranks[rank]
        return records[-1].position + records[-1].length if records else 0

    def metadata_bytes(self) -> bytes:
        chunks: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {flat_key(t.path): [] for t in self.tensors}
        storage = []
        for rank, records in enumerate(self.ranks):
            for record in records:
                if record.chunk is not None:
                    chunks[record.key].append((record.chunk.offsets, record.chunk.sizes))
                offsets = record.chunk.offsets if record.chunk is not None else None
                storage.append((record.key, offsets, record.index, rank_file_name(rank), record.position, record.length))
        return _metadata_bytes(self.tensors, [path for path, _ in self.items], chunks, storage)


def plan_dcp(tensors: list[OutTensor], bytes_items: list[OutBytes], *, world_size: int) -> DcpPlan:
    """Each tensor chunked as FSDP2 at `world_size` ranks (dim 0 by `torch.chunk`, scalars and the
    bytes items, read here, in rank 0's file)."""
    by_rank: list[list[DcpChunk]] = [[] for _ in range(world_size)]
    for tensor in tensors:
        shape = tuple(tensor.source.shape)
        if not shape:
            by_rank[0].append(DcpChunk(tensor, (), ()))
            continue
        for rank, (start, end) in enumerate(dim0_chunks(shape[0], world_size)):
            if start < end:
                by_rank[rank].append(DcpChunk(tensor, (start, *[0] * (len(shape) - 1)), (end - start, *shape[1:])))
    items = [(item.path, item.read()) for item in bytes_items]
    counts: dict[str, int] = {}
    ranks = []
    for rank, rank_chunks in enumerate(by_rank):
        records, position = [], 0
        for chunk in rank_chunks:
            key = flat_key(chunk.tensor.path)
            head, tail = chunk.archive()
            data = chunk.wanted.size * dtype_info(chunk.tensor.source.dtype).itemsize
            begin = position + len(head)
            records.append(DcpRecord(key, position, len(head) + data + len(tail), chunk, counts.get(key, 0), None, begin, begin + data))
            counts[key] = counts.get(key, 0) + 1
            position += records[-1].length
        for path, item in items if rank == 0 else []:
            records.append(DcpRecord(flat_key(path), position, len(item), item=item))
            position += len(item)
        ranks.append(records)
    return DcpPlan(tensors, items, ranks)


def write_dcp(
    directory: Path, tensors: list[OutTensor], bytes_items: list[OutBytes], *, world_size: int, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[str]:
    """Every rank file and `.metadata` in `directory`, not synced (the caller's staged output syncs); the rank files' names."""
    plan = plan_dcp(tensors, bytes_items, world_size=world_size)
    copier = ByteEngine(chunk_size=chunk_size)
    try:
        for rank, records in enumerate(plan.ranks):
            with RawOutput(directory / rank_file_name(rank), copier) as out:
                for record in records:
                    if record.chunk is None:
                        assert record.item is not None
                        out.write(record.item)
                        continue
                    head, tail = record.chunk.archive()
                    out.write(head)
                    out.copy(record.chunk.tensor.source, record.chunk.wanted)
                    out.write(tail)
        check_parts(copier.finish_parts())
    finally:
        copier.close()
    with open(directory / METADATA_NAME, "wb") as f:
        f.write(plan.metadata_bytes())
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


def _metadata_bytes(tensors: list[OutTensor], bytes_paths: list[DcpPath], chunks: dict, storage: list[tuple]) -> bytes:
    """DCP's `Metadata` as FileSystemWriter's finish pickles it (version 1.0.0, no storage_meta)."""
    tensor_items = ((flat_key(t.path), _tensor_metadata(t.source.dtype, tuple(t.source.shape), chunks[flat_key(t.path)])) for t in tensors)
    byte_items = ((flat_key(path), NewObject(_dcp("BytesStorageMetadata"), {})) for path in bytes_paths)
    state = {
        "state_dict_metadata": Pairs(itertools.chain(tensor_items, byte_items)),
        "planner_data": {flat_key(t.path): t.path for t in tensors} | {flat_key(path): path for path in bytes_paths},
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
