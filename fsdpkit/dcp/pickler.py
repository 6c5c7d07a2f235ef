"""DCP's `.metadata` pickle, written without torch.

A pickle is a byte stream of opcodes; the globals it names are only looked up when it is
loaded. `metadata_pickle` emits (protocol 2) exactly the objects torch 2.13's
`FileSystemWriter` pickles: `Metadata`, `TensorStorageMetadata`, `ChunkStorageMetadata`,
`BytesStorageMetadata`, `MetadataIndex` (dataclasses: `copyreg.__newobj__` + their `__dict__`),
`TensorProperties` (its `__getstate__` tuple), `_StorageInfo` (its `__dict__` without the
None fields), `torch.Size`, dtypes (`torch.float32`), `torch.strided` and the contiguous memory
format, so `pickle.load` in torch gives DCP's real classes and fsdpkit's allow-list unpickler
reads it too. No memo: every object is written where it occurs.
"""

from __future__ import annotations

import struct
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
class Pairs:
    """A dict given as its (key, value) pairs: the keys here are records, not hashable."""

    items: list


@dataclass(frozen=True)
class NewObject:
    """`cls.__new__(cls)` given `state` by pickle's BUILD (`__setstate__`, else its `__dict__`)."""

    cls: Global
    state: Any


def _text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _emit(value: Any, out: list[bytes]) -> None:
    if value is None:
        out.append(b"N")
    elif value is True or value is False:
        out.append(b"\x88" if value else b"\x89")
    elif isinstance(value, int):
        out.append(_int(value))
    elif isinstance(value, str):
        out.append(_text(value))
    elif isinstance(value, tuple):
        out.append(b"(")
        for item in value:
            _emit(item, out)
        out.append(b"t")
    elif isinstance(value, list):
        out.append(b"](")
        for item in value:
            _emit(item, out)
        out.append(b"e")
    elif isinstance(value, dict):
        out.append(b"}(")
        for key, item in value.items():
            _emit(key, out)
            _emit(item, out)
        out.append(b"u")
    elif isinstance(value, Pairs):
        out.append(b"}(")
        for key, item in value.items:
            _emit(key, out)
            _emit(item, out)
        out.append(b"u")
    elif isinstance(value, Global):
        out.append(f"c{value.module}\n{value.name}\n".encode())
    elif isinstance(value, Reduce):
        _emit(value.function, out)
        _emit(value.args, out)
        out.append(b"R")
    elif isinstance(value, NewObject):
        _emit(value.cls, out)
        out.append(b")\x81")  # NEWOBJ with no arguments
        _emit(value.state, out)
        out.append(b"b")
    else:
        raise TypeError(f"cannot pickle {type(value).__name__} here")


def dumps(value: Any) -> bytes:
    out = [b"\x80\x02"]
    _emit(value, out)
    out.append(b".")
    return b"".join(out)


def _dcp(name: str) -> Global:
    return Global(DCP_METADATA_MODULE, name)


def size(values: tuple[int, ...]) -> Reduce:
    return Reduce(Global("torch", "Size"), (tuple(values),))


def tensor_metadata(dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> NewObject:
    """A `TensorStorageMetadata` of a tensor of `dtype` (safetensors spelling) and `shape`."""
    layout = Reduce(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduce(_dcp("_MEM_FORMAT_ENCODING"), (0,))
    properties = NewObject(_dcp("TensorProperties"), (Global("torch", _TORCH_NAMES[dtype]), layout, False, contiguous, False))
    chunk_list = [NewObject(_dcp("ChunkStorageMetadata"), {"offsets": size(o), "sizes": size(s)}) for o, s in chunks]
    return NewObject(_dcp("TensorStorageMetadata"), {"properties": properties, "size": size(shape), "chunks": chunk_list})


def bytes_metadata() -> NewObject:
    return NewObject(_dcp("BytesStorageMetadata"), {})


def metadata_index(fqn: str, offsets: tuple[int, ...] | None, index: int | None) -> NewObject:
    return NewObject(_dcp("MetadataIndex"), {"fqn": fqn, "offset": None if offsets is None else size(offsets), "index": index})


def storage_info(relative_path: str, offset: int, length: int) -> NewObject:
    return NewObject(Global(DCP_FILESYSTEM_MODULE, "_StorageInfo"), {"relative_path": relative_path, "offset": offset, "length": length})


def metadata(items: dict[str, NewObject], planner_data: dict, storage_data: list[tuple[NewObject, NewObject]]) -> bytes:
    """The pickled `Metadata` (version 1.0.0, no storage_meta, as FileSystemWriter's finish)."""
    state = {
        "state_dict_metadata": items,
        "planner_data": planner_data,
        "storage_data": Pairs(storage_data),
        "storage_meta": None,
        "version": "1.0.0",
    }
    return dumps(NewObject(_dcp("Metadata"), state))
