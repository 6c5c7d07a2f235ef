"""DCP's `.metadata` pickle, written without torch (`torchfile.pickler`).

`metadata` emits (protocol 2) exactly the objects torch 2.13's `FileSystemWriter` pickles:
`Metadata`, `TensorStorageMetadata`, `ChunkStorageMetadata`, `BytesStorageMetadata`,
`MetadataIndex` (dataclasses: `copyreg.__newobj__` + their `__dict__`), `TensorProperties`
(its `__getstate__` tuple), `_StorageInfo` (its `__dict__` without the None fields),
`torch.Size`, dtypes (`torch.float32`), `torch.strided` and the contiguous memory format, so
`pickle.load` in torch gives DCP's real classes and fsdpkit's allow-list unpickler reads it
too. The records of every chunk and storage entry (a million at a large world size) are
pickled directly as `Raw` bytes, made one at a time as they are written; the globals and keys
they repeat are memoized once.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..torchfile.pickler import Global, NewObject, Pairs, Raw, Reduce, dumps, pickled_int, pickled_text
from ..torchfile.unpickler import TORCH_DTYPE_NAMES
from .unpickler import DCP_FILESYSTEM_MODULE, DCP_METADATA_MODULE


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
    """`torch.Size(values)`: the hot path (a million of them at a large world size) is written
    directly rather than through `emit`."""
    return _SIZE + b"((" + b"".join(map(pickled_int, values)) + b"ttR"


def tensor_metadata(dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> NewObject:
    """A `TensorStorageMetadata` of a tensor of `dtype` (safetensors spelling) and `shape`."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_dcp("_MEM_FORMAT_ENCODING"), (0,))
    properties = NewObject(_dcp("TensorProperties"), (Global("torch", TORCH_DTYPE_NAMES[dtype]), layout, False, contiguous, False))
    chunk_list = [Raw(_CHUNK + _size(o) + _SIZES + _size(s) + b"ub") for o, s in chunks]
    return NewObject(_dcp("TensorStorageMetadata"), {"properties": properties, "size": Raw(_size(shape)), "chunks": chunk_list})


def bytes_metadata() -> NewObject:
    return NewObject(_dcp("BytesStorageMetadata"), {})


def metadata_index(fqn: str, offsets: tuple[int, ...] | None, index: int | None) -> Raw:
    offset = b"N" if offsets is None else _size(offsets)
    return Raw(_INDEX + pickled_text(fqn) + _OFFSET + offset + _INDEX_KEY + (b"N" if index is None else pickled_int(index)) + b"ub")


def storage_info(relative_path: str, offset: int, length: int) -> Raw:
    return Raw(_STORAGE + pickled_text(relative_path) + _OFFSET + pickled_int(offset) + _LENGTH + pickled_int(length) + b"ub")


def metadata(items: Iterable[tuple[str, NewObject]], planner_data: dict, storage_data: Iterable[tuple[Raw, Raw]]) -> bytes:
    """The pickled `Metadata` (version 1.0.0, no storage_meta, as FileSystemWriter's finish)."""
    state = {
        "state_dict_metadata": Pairs(items),
        "planner_data": planner_data,
        "storage_data": Pairs(storage_data),
        "storage_meta": None,
        "version": "1.0.0",
    }
    return dumps(NewObject(_dcp("Metadata"), state), memo=_PRELUDE)
