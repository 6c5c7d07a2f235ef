"""DCP's `.metadata` pickle, written without torch.

A pickle is a byte stream of opcodes; the globals it names are only looked up when it is
loaded. `metadata` emits (protocol 2) exactly the objects torch 2.13's
`FileSystemWriter` pickles: `Metadata`, `TensorStorageMetadata`, `ChunkStorageMetadata`,
`BytesStorageMetadata`, `MetadataIndex` (dataclasses: `copyreg.__newobj__` + their `__dict__`),
`TensorProperties` (its `__getstate__` tuple), `_StorageInfo` (its `__dict__` without the
None fields), `torch.Size`, dtypes (`torch.float32`), `torch.strided` and the contiguous memory
format, so `pickle.load` in torch gives DCP's real classes and fsdpkit's allow-list unpickler
reads it too. The records of every chunk and storage entry (a million at a large world size)
are pickled directly as `Raw` bytes, made one at a time as they are written; the globals and
keys they repeat are memoized once.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .unpickler import DCP_FILESYSTEM_MODULE, DCP_METADATA_MODULE, TORCH_DTYPES

_TORCH_NAMES = {dtype: name for name, dtype in reversed(list(TORCH_DTYPES.items()))}  # the canonical spelling comes first


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """`callable(*args)` when loaded."""

    function: Global
    args: tuple


@dataclass(frozen=True)
class Raw:
    """Bytes already pickled."""

    data: bytes


@dataclass(frozen=True)
class Pairs:
    """A dict given as its (key, value) pairs, made as they are written (the keys here are
    records, not hashable; a large checkpoint has a million objects, never all alive)."""

    items: Iterable[tuple[Any, Any]]


@dataclass(frozen=True)
class Ordered:
    """An `collections.OrderedDict` of `items` (pairs), in their order."""

    items: Iterable[tuple[Any, Any]]


@dataclass(frozen=True)
class NewObject:
    """`cls.__new__(cls)` given `state` by pickle's BUILD (`__setstate__`, else its `__dict__`)."""

    cls: Global
    state: Any


def pickled_text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


def pickled_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _emit(value: Any, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        out += pickled_int(value)
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        out += pickled_text(value)
    elif isinstance(value, tuple):
        out += b"("
        for item in value:
            _emit(item, out)
        out += b"t"
    elif isinstance(value, list):
        out += b"]("
        for item in value:
            _emit(item, out)
        out += b"e"
    elif isinstance(value, (dict, Pairs)):
        out += b"}("
        for key, item in value.items() if isinstance(value, dict) else value.items:
            _emit(key, out)
            _emit(item, out)
        out += b"u"
    elif isinstance(value, Ordered):
        out += b"ccollections\nOrderedDict\n)R("
        for key, item in value.items:
            _emit(key, out)
            _emit(item, out)
        out += b"u"
    elif isinstance(value, Raw):
        out += value.data
    elif isinstance(value, Global):
        out += f"c{value.module}\n{value.name}\n".encode()
    elif isinstance(value, Reduce):
        _emit(value.function, out)
        _emit(value.args, out)
        out += b"R"
    elif isinstance(value, NewObject):
        _emit(value.cls, out)
        out += b")\x81"  # NEWOBJ with no arguments
        _emit(value.state, out)
        out += b"b"
    else:
        raise TypeError(f"cannot pickle {type(value).__name__} here")


def dumps(value: Any, *, prelude: bool = True) -> bytes:
    """`value` pickled; with `prelude`, DCP's repeated globals memoized first (`metadata` needs
    them; other files name no DCP class)."""
    out = bytearray(b"\x80\x02" + (_PRELUDE if prelude else b""))
    _emit(value, out)
    out += b"."
    return bytes(out)


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
    directly rather than through `_emit`."""
    return _SIZE + b"((" + b"".join(map(pickled_int, values)) + b"ttR"


def tensor_metadata(dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> NewObject:
    """A `TensorStorageMetadata` of a tensor of `dtype` (safetensors spelling) and `shape`."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_dcp("_MEM_FORMAT_ENCODING"), (0,))
    properties = NewObject(_dcp("TensorProperties"), (Global("torch", _TORCH_NAMES[dtype]), layout, False, contiguous, False))
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
    return dumps(NewObject(_dcp("Metadata"), state))
