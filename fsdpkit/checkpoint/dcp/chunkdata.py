"""Where a DCP chunk's raw tensor bytes lie inside its `.distcp` file (no torch).

`torch_save` serialization: each chunk is a whole `torch.save` archive (`torchfile.savefile`)
at its byte range. Its data.pkl, read with the allow-list unpickler, must be a contiguous
little-endian tensor of the chunk's shape and dtype inside its storage (a view at a storage
offset is read from there; a non-contiguous one is refused, naming the chunk); its bytes are
then a plain byte range of the file.

`safetensors` serialization: each file is the rank's bytes items followed by one
safetensors blob of its chunks (named by the flattened key, their offsets in the blob's
`DCP_SHARDING_INFO` metadata); every chunk's storage entry points at the blob's start.
"""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataCheckError
from ..format.files import read_exactly
from ..format.names import MAX_HEADER_BYTES, Header, parse_header_bytes
from ..torchfile import unpickler as u
from ..torchfile.savefile import record_start, tensor_bytes, torch_save_pickle

SHARDING_INFO_KEY = "DCP_SHARDING_INFO"
TORCH_SAVE, SAFETENSORS = "torch_save", "safetensors"


@dataclass(frozen=True)
class ChunkData:
    offset: int  # absolute offset of the chunk's first data byte in its file
    nbytes: int
    serialization: str


def torch_save_data(fd: int, path: Path, start: int, length: int, *, key: str, dtype: str, shape: tuple[int, ...]) -> ChunkData:
    """The data range of the `torch.save` archive at byte `start`, checked against the chunk's dtype and shape."""
    where = f"{path}: chunk of {key!r} at byte {start}"
    try:
        archive, prefix, raw = torch_save_pickle(fd, path, start, length, where)
        record = u.restricted_loads(raw, allowed=u.TENSOR_GLOBALS, where=f"{where} data.pkl", storages=True)
        if not isinstance(record, u.TensorRecord):
            raise DataCheckError(f"{where}: holds a {type(record).__name__}, not a tensor")
        info = archive.getinfo(f"{prefix}data/{record.storage.key}")
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError) as error:
        raise DataCheckError(f"{where}: not a readable torch.save archive ({str(error)[:100]})") from None
    found = record.dtype or record.storage.storage_type.dtype
    if found != dtype:
        raise DataCheckError(f"{where}: holds {found}, the metadata says {dtype}")
    if record.shape != shape:
        raise DataCheckError(f"{where}: holds shape {list(record.shape)}, the metadata says {list(shape)}")
    _, skip, nbytes = tensor_bytes(record, info.file_size, where)
    return ChunkData(start + record_start(fd, path, start, length, info, where) + skip, nbytes, TORCH_SAVE)


def safetensors_blob(fd: int, path: Path, start: int, size: int) -> tuple[Header, dict]:
    """The header of the safetensors blob at byte `start` of `path`, and its sharding info."""
    if start + 8 > size:
        raise DataCheckError(f"{path}: no safetensors header at byte {start} (truncated)")
    (header_len,) = struct.unpack("<Q", read_exactly(fd, 8, start, path))
    if header_len > MAX_HEADER_BYTES or start + 8 + header_len > size:
        raise DataCheckError(f"{path}: safetensors header at byte {start} claims {header_len} bytes (truncated or not safetensors)")
    header = parse_header_bytes(read_exactly(fd, header_len, start + 8, path), path=path)
    if start + header.file_size > size:
        raise DataCheckError(f"{path}: safetensors data at byte {start} ends at {start + header.file_size}, the file at {size} (truncated)")
    try:
        sharding = json.loads(header.metadata.get(SHARDING_INFO_KEY, "{}"))
    except ValueError:
        raise DataCheckError(f"{path}: {SHARDING_INFO_KEY} is not JSON") from None
    return header, sharding if isinstance(sharding, dict) else {}


def safetensors_data(
    path: Path, start: int, blob: tuple[Header, dict], *, key: str, dtype: str, shape: tuple[int, ...], offsets: tuple[int, ...]
) -> ChunkData:
    header, sharding = blob
    info = header.tensors.get(key)
    where = f"{path}: chunk of {key!r}"
    if info is None:
        raise DataCheckError(f"{where} is missing from the safetensors data at byte {start}")
    if info.dtype != dtype or info.shape != shape:
        raise DataCheckError(f"{where}: holds {info.dtype}{list(info.shape)}, the metadata says {dtype}{list(shape)}")
    saved = (sharding.get(key) or {}).get("saved_offsets")
    if saved is not None and tuple(saved) != offsets:
        raise DataCheckError(f"{where}: the file holds the chunk at {saved}, the metadata at {list(offsets)}")
    return ChunkData(start + header.data_start + info.begin, info.nbytes, SAFETENSORS)
