"""A `torch.save` zip read at a byte range of an open file, without torch and without zipfile's
CRC checks: torch.save with crc32 off writes 0 for every record's crc32, which zipfile refuses.

`Window` is the range as a seekable file (for zipfile's central directory); `record_start`
finds a stored record's data through its local header.
"""

from __future__ import annotations

import io
import math
import struct
import zipfile
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ..format.files import read_exactly, read_some
from ..format.names import numel
from .unpickler import TensorRecord

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes


class Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable read-only file."""

    def __init__(self, fd: int, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        count = max(0, min(len(buffer), self._length - self._position))
        done = read_some(self._fd, self._start + self._position, memoryview(buffer).cast("B")[:count]) if count else 0
        self._position += done
        return done


def record_start(fd: int, path: Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> int:
    """Where the stored record `info` starts inside the archive at `start` (its local header read)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise DataCheckError(f"{where}: record {info.filename} is compressed")
    header = read_exactly(fd, LOCAL_HEADER.size, start + info.header_offset, path)
    magic, *_, name_length, extra_length = LOCAL_HEADER.unpack(header)
    if magic != ZIP_MAGIC:
        raise DataCheckError(f"{where}: the header of record {info.filename} is damaged")
    data_start = info.header_offset + LOCAL_HEADER.size + name_length + extra_length
    if data_start + info.file_size > length:
        raise DataCheckError(f"{where}: record {info.filename} ends past the archive's {length} bytes")
    return data_start


def read_record(fd: int, path: Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> bytes:
    """A small stored record's bytes."""
    return read_exactly(fd, info.file_size, start + record_start(fd, path, start, length, info, where), path)


def torch_save_pickle(fd: int, path: Path, start: int, length: int, where: str) -> tuple[zipfile.ZipFile, str, bytes]:
    """(the zip, its records' prefix, its data.pkl's bytes) of the `torch.save` archive at byte
    `start`; a big-endian one is refused. A damaged zip raises zipfile's and os's errors."""
    archive = zipfile.ZipFile(Window(fd, start, length))
    names = archive.namelist()
    pickles = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise DataCheckError(f"{where}: not a torch.save archive (no data.pkl)")
    prefix = pickles[0][: -len("data.pkl")]
    byteorder = f"{prefix}byteorder"
    if byteorder in names and read_record(fd, path, start, length, archive.getinfo(byteorder), where) != b"little":
        raise DataCheckError(f"{where}: big-endian data is not supported")
    return archive, prefix, read_record(fd, path, start, length, archive.getinfo(pickles[0]), where)


def tensor_bytes(record: TensorRecord, stored: int, where: str) -> tuple[str, int, int]:
    """(dtype, bytes before the tensor's data in its storage of `stored` bytes, the data's bytes)
    of a contiguous tensor inside its storage; anything else is refused."""
    dtype = record.dtype or record.storage.storage_type.dtype
    if dtype is None:
        raise DataCheckError(f"{where}: a tensor without a dtype")
    contiguous = [math.prod(record.shape[d + 1 :]) for d in range(len(record.shape))]
    if any(s != c for s, c, d in zip(record.stride, contiguous, record.shape, strict=True) if d > 1):
        raise DataCheckError(f"{where}: tensor is not contiguous (stride {list(record.stride)}), which fsdpkit does not read")
    itemsize = dtype_info(dtype).itemsize
    skip, nbytes = record.storage_offset * itemsize, numel(record.shape) * itemsize
    if record.storage_offset < 0 or skip + nbytes > stored:
        raise DataCheckError(f"{where}: {nbytes} bytes at element {record.storage_offset} of a storage of {stored} bytes (outside it)")
    return dtype, skip, nbytes
