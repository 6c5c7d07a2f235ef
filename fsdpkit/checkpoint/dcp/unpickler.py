"""The allow-list for DCP's `.metadata`: torch's allow-list (`torchfile.unpickler`) plus DCP's
metadata dataclasses, the checkpoint path, as inert records (never imported)."""

from __future__ import annotations

from typing import Any

from ...errors import DataCheckError
from ..torchfile.unpickler import TORCH_DTYPES, Dtype, Record, memory_format, ordered_dict, tensor_layout, torch_size

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"


class Metadata(Record):
    pass


class TensorStorageMetadata(Record):
    pass


class BytesStorageMetadata(Record):
    pass


class ChunkStorageMetadata(Record):
    pass


class TensorProperties(Record):
    pass


class StorageMeta(Record):
    pass


class MetadataIndex(Record):
    pass


class StorageInfo(Record):
    pass


def _path(*parts: Any) -> str:
    if not all(isinstance(part, str) for part in parts):
        raise DataCheckError("a pickled path must be made of strings")
    return "/".join(parts)


METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    (DCP_METADATA_MODULE, "Metadata"): Metadata,
    (DCP_METADATA_MODULE, "TensorStorageMetadata"): TensorStorageMetadata,
    (DCP_METADATA_MODULE, "BytesStorageMetadata"): BytesStorageMetadata,
    (DCP_METADATA_MODULE, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (DCP_METADATA_MODULE, "TensorProperties"): TensorProperties,
    (DCP_METADATA_MODULE, "StorageMeta"): StorageMeta,
    (DCP_METADATA_MODULE, "MetadataIndex"): MetadataIndex,
    (DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"): memory_format,
    (DCP_FILESYSTEM_MODULE, "_StorageInfo"): StorageInfo,
    ("torch", "Size"): torch_size,
    ("torch.serialization", "_get_layout"): tensor_layout,
    ("pathlib", "PosixPath"): _path,
    ("pathlib", "WindowsPath"): _path,
    ("pathlib", "PurePosixPath"): _path,
    ("pathlib", "Path"): _path,
    ("collections", "OrderedDict"): ordered_dict,
    **{("torch", name): Dtype(dtype) for name, dtype in TORCH_DTYPES.items()},
}
