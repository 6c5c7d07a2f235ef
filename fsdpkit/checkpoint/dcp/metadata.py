"""DCP's `.metadata` (no torch), read through the allow-list unpickler (torch's, plus DCP's
classes as inert records) and checked into plain records.

torch 2.13's `FileSystemWriter` pickles a `Metadata`: `state_dict_metadata` maps each
flattened key to a `TensorStorageMetadata` (properties with the dtype, size, chunks as
offsets + sizes) or a `BytesStorageMetadata`; `storage_data` maps `MetadataIndex(fqn,
offset)` to `_StorageInfo(relative_path, offset, length)`, where the item's bytes lie;
`planner_data` maps each flattened key to its path in the nested state dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...errors import DataCheckError
from ..core.files import read_exactly, regular_file, source_path
from ..core.names import is_safe_file_name, numel
from ..torchfile.unpickler import TORCH_DTYPES, Dtype, Record, memory_format, ordered_dict, restricted_loads, tensor_layout, torch_size

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
METADATA_NAME = ".metadata"
MAX_METADATA_BYTES = 1 << 30
DcpPath = tuple[str | int, ...]  # where an item sits in the nested state dict, e.g. ("model", "wte.weight")


def flat_key(path: DcpPath) -> str:
    return ".".join(str(part) for part in path)


@dataclass(frozen=True)
class Location:
    file: str  # a file name inside the checkpoint directory
    offset: int
    length: int


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: Location


@dataclass(frozen=True)
class DcpTensor:
    key: str  # the flattened key
    dtype: str  # safetensors spelling
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class DcpBytes:
    key: str
    location: Location


@dataclass(frozen=True)
class DcpMetadata:
    directory: str  # the checkpoint's directory or URL
    version: str | None
    tensors: dict[str, DcpTensor]
    bytes_items: dict[str, DcpBytes]
    paths: dict[str, DcpPath]  # flattened key -> its path (may be empty)

    @property
    def files(self) -> list[str]:
        names = {c.location.file for t in self.tensors.values() for c in t.chunks} | {b.location.file for b in self.bytes_items.values()}
        return sorted(names)


# `StorageInfo` is the filesystem module's `_StorageInfo`, the others are the metadata module's
RECORDS: dict[str, type[Record]] = {
    name: type(name, (Record,), {})
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "MetadataIndex",
        "StorageInfo",
    )
}


def _path(*parts: Any) -> str:
    if not all(isinstance(part, str) for part in parts):
        raise DataCheckError("a pickled path must be made of strings")
    return "/".join(parts)


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(DCP_METADATA_MODULE, name): record for name, record in RECORDS.items() if name != "StorageInfo"},
    (DCP_FILESYSTEM_MODULE, "_StorageInfo"): RECORDS["StorageInfo"],
    (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): memory_format,
    ("torch", "Size"): torch_size,
    ("torch.serialization", "_get_layout"): tensor_layout,
    **{("pathlib", name): _path for name in ("PosixPath", "WindowsPath", "PurePosixPath", "Path")},
    ("collections", "OrderedDict"): ordered_dict,
    **{("torch", name): Dtype(dtype) for name, dtype in TORCH_DTYPES.items()},
}


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A directory holding DCP's `.metadata` (whatever it holds: reading it checks that)."""
    return source_path(path).is_dir() and (source_path(path) / METADATA_NAME).exists()


def read_metadata(directory: str | os.PathLike[str], allowed: Mapping[tuple[str, str], Any] = METADATA_GLOBALS) -> DcpMetadata:
    """`allowed`: the unpickler's allow-list (a format built on DCP adds its own records)."""
    path = source_path(directory) / METADATA_NAME
    with regular_file(path) as (fd, size):
        if size > MAX_METADATA_BYTES:
            raise DataCheckError(f"{path}: {size} bytes, over the {MAX_METADATA_BYTES}-byte limit for DCP metadata")
        raw = read_exactly(fd, size, 0, path)
    return parse_metadata(raw, str(directory), where=str(path), allowed=allowed)


def parse_metadata(raw: bytes, directory: str, *, where: str, allowed: Mapping[tuple[str, str], Any] = METADATA_GLOBALS) -> DcpMetadata:
    """The metadata of the DCP checkpoint at `directory` (a path or URL) from its `.metadata`'s
    bytes `raw` (read from `where`), through the allow-list unpickler (`allowed`)."""
    path = where
    root = restricted_loads(raw, allowed=dict(allowed), where=where)
    if not isinstance(root, RECORDS["Metadata"]):
        raise DataCheckError(f"{path}: holds a {type(root).__name__}, not DCP metadata")
    items, storage = root.get("state_dict_metadata"), root.get("storage_data")
    if not isinstance(items, dict) or not isinstance(storage, dict):
        raise DataCheckError(f"{path}: DCP metadata without state_dict_metadata or storage_data (not written by FileSystemWriter?)")
    locations = _locations(path, storage)
    tensors: dict[str, DcpTensor] = {}
    bytes_items: dict[str, DcpBytes] = {}
    for key, item in items.items():
        if not isinstance(key, str):
            raise DataCheckError(f"{path}: a key of type {type(key).__name__}, expected str")
        if isinstance(item, RECORDS["BytesStorageMetadata"]):
            location = locations.get((key, None))
            if location is None:
                raise DataCheckError(f"{path}: bytes item {key!r} has no storage entry")
            bytes_items[key] = DcpBytes(key, location)
        elif isinstance(item, RECORDS["TensorStorageMetadata"]):
            tensors[key] = _tensor(path, key, item, locations)
        else:
            raise DataCheckError(f"{path}: item {key!r} is a {type(item).__name__}, expected tensor or bytes metadata")
    version = root.get("version")
    return DcpMetadata(directory, version if isinstance(version, str) else None, tensors, bytes_items, _paths(root.get("planner_data")))


def _locations(where: str, storage: dict) -> dict[tuple[str, tuple[int, ...] | None], Location]:
    found: dict[tuple[str, tuple[int, ...] | None], Location] = {}
    for index, info in storage.items():
        if not isinstance(index, RECORDS["MetadataIndex"]) or not isinstance(info, RECORDS["StorageInfo"]):
            raise DataCheckError(
                f"{where}: storage_data holds {type(index).__name__} -> {type(info).__name__}, expected DCP's storage info"
            )
        fqn, offset = index.get("fqn"), index.get("offset")
        name, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(fqn, str) or not (offset is None or isinstance(offset, tuple)):
            raise DataCheckError(f"{where}: malformed storage index {str(index.__dict__)[:80]}")
        if info.get("transform_descriptors"):
            raise DataCheckError(f"{where}: item {fqn!r} is stored through transforms {info.get('transform_descriptors')} (not supported)")
        if not is_safe_file_name(name):
            raise DataCheckError(f"{where}: item {fqn!r} names file {str(name)[:80]!r}, not a plain file name inside the checkpoint")
        if type(start) is not int or type(length) is not int or start < 0 or length < 0:
            raise DataCheckError(f"{where}: item {fqn!r} has byte range {start!r}+{length!r}")
        found[(fqn, offset)] = Location(name, start, length)
    return found


def _tensor(where: str, key: str, item: Record, locations: dict) -> DcpTensor:
    properties, shape, chunks = item.get("properties"), item.get("size"), item.get("chunks")
    state = properties.get("state") if isinstance(properties, RECORDS["TensorProperties"]) else None
    if not isinstance(state, tuple) or not state or not isinstance(state[0], Dtype):
        raise DataCheckError(f"{where}: tensor {key!r} has no dtype in its properties")
    if not isinstance(shape, tuple) or not isinstance(chunks, list):
        raise DataCheckError(f"{where}: tensor {key!r} has no size or chunk list")
    parsed = []
    for chunk in chunks:
        offsets, sizes = (chunk.get("offsets"), chunk.get("sizes")) if isinstance(chunk, RECORDS["ChunkStorageMetadata"]) else (None, None)
        if not isinstance(offsets, tuple) or not isinstance(sizes, tuple) or len(offsets) != len(shape) or len(sizes) != len(shape):
            raise DataCheckError(f"{where}: tensor {key!r} {list(shape)} has a chunk of another rank: {offsets} + {sizes}")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise DataCheckError(f"{where}: tensor {key!r} {list(shape)} has a chunk {list(offsets)} + {list(sizes)} outside it")
        if not numel(sizes):
            continue  # an empty shard (more ranks than rows): nothing stored
        location = locations.get((key, offsets))
        if location is None:
            raise DataCheckError(f"{where}: tensor {key!r} chunk at {list(offsets)} has no storage entry")
        parsed.append(Chunk(offsets, sizes, location))
    return DcpTensor(key, state[0].name, shape, tuple(parsed))


def _paths(planner_data: Any) -> dict[str, DcpPath]:
    """The default planner's {flattened key: path}; empty when another planner wrote none."""
    pairs = planner_data.items() if isinstance(planner_data, dict) else ()
    return {k: p for k, p in pairs if isinstance(k, str) and isinstance(p, tuple) and all(isinstance(x, (str, int)) for x in p)}
