"""A `torch.save` zip read without torch: at a byte range of an open file (a DCP chunk), or a
whole file (`SaveFile`: a DeepSpeed rank file, a per-rank state dict) with its `data.pkl`
through a format's allow-list unpickler and its storages (stored records `<archive>/data/<key>`,
each with the zip's CRC-32) as byte ranges the byte engine reads when asked. Records are read
through their local headers, not zipfile: torch.save with crc32 off writes 0 for every record's
crc32, which zipfile refuses.
"""

from __future__ import annotations

import io
import math
import struct
import threading
import zipfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.crc import StorageSpan, crc32
from ..core.files import Descriptor, close, open_regular, prefetch, read_exactly, read_some
from ..core.names import numel
from ..core.report import VerifyReport
from .unpickler import TensorRecord

ZIP_MAGIC = b"PK\x03\x04"
LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # zip local file header: 30 bytes
OPENS_IN_FLIGHT = 8  # files `open_each` opens at once
LOCAL_HEADER_READ_BYTES = 4096  # a local header with its name and extra field, fetched ahead in an object


class Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a seekable read-only file."""

    def __init__(self, fd: Descriptor, start: int, length: int):
        super().__init__()
        self._fd, self._start, self._length, self._position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._position, 2: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer) -> int:  # type: ignore[no-untyped-def]
        count = max(0, min(len(buffer), self._length - self._position))
        done = read_some(self._fd, self._start + self._position, memoryview(buffer).cast("B")[:count]) if count else 0
        self._position += done
        return done


def record_start(fd: Descriptor, path: str | Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> int:
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


def read_record(fd: Descriptor, path: str | Path, start: int, length: int, info: zipfile.ZipInfo, where: str) -> bytes:
    return read_exactly(fd, info.file_size, start + record_start(fd, path, start, length, info, where), path)


def open_each(paths: Sequence[Path], open_one: Callable[[int, Path], SaveFile], opened: list[SaveFile]) -> None:
    """`open_one(number, path)` of each of `paths` appended to `opened` in order, OPENS_IN_FLIGHT at
    once (an object's headers are requests that wait on the network). Where one fails, those
    that opened are in `opened` (the caller closes them), those not yet started are not opened,
    and the first failure is raised."""
    failed = threading.Event()

    def open_unless_failed(number: int, path: Path) -> SaveFile | None:
        if failed.is_set():
            return None
        try:
            return open_one(number, path)
        except BaseException:
            failed.set()
            raise

    with ThreadPoolExecutor(min(OPENS_IN_FLIGHT, max(1, len(paths))), thread_name_prefix="fsdpkit-open") as pool:
        futures = [pool.submit(open_unless_failed, number, path) for number, path in enumerate(paths)]
    failure: BaseException | None = None
    for future in futures:
        try:
            if (saved := future.result()) is not None:
                opened.append(saved)
        except BaseException as error:
            failure = failure or error
    if failure is not None:
        raise failure


def torch_save_pickle(fd: Descriptor, path: str | Path, start: int, length: int, where: str) -> tuple[zipfile.ZipFile, str, bytes]:
    """(the zip, its records' prefix, its data.pkl) of the `torch.save` archive at byte `start`, not big-endian."""
    archive = zipfile.ZipFile(Window(fd, start, length))
    prefetch(fd, [start + info.header_offset for info in archive.infolist()], LOCAL_HEADER_READ_BYTES)
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


CRC_BLOCK = 1 << 20


@dataclass(frozen=True)
class StorageEntry:
    offset: int  # absolute byte offset of the storage's first byte in the file
    nbytes: int
    crc32: int  # the zip's CRC-32 of the entry (0: torch.save wrote none)


@dataclass(frozen=True)
class TensorRange:
    path: Path
    offset: int  # absolute byte offset of element 0
    numel: int
    dtype: str
    storage: StorageSpan | None = None  # the zip record it lies in, with its CRC-32 (None: not a zip's, or none recorded)

    def piece(self, name: str, first: int, count: int, dest: int) -> SourcePiece:
        """Its elements [first, first + count), placed at [dest, dest + count) of tensor `name`."""
        itemsize = dtype_info(self.dtype).itemsize
        offset = self.offset + first * itemsize
        return SourcePiece(ElementRange(dest, dest + count), self.path, offset, count * itemsize, None, name, self.storage)


class SaveFile:
    """An open `torch.save` file: `state` (the unpickled tree, tensors as `TensorRecord`s), storages."""

    def __init__(self, path: Path, unpickle: Callable[..., Any]):
        """`unpickle(raw, where=...)`: the allow-list unpickler of its data.pkl."""
        self.path = path
        self.fd, self.size = open_regular(path)
        try:
            self.state, self.storages = self._read(unpickle)
        except BaseException:
            close(self.fd)
            raise

    def close(self) -> None:
        if self.size >= 0:
            close(self.fd)
            self.size = -1  # closed

    def _read(self, unpickle: Callable[..., Any]) -> tuple[Any, dict[str, StorageEntry]]:
        where = str(self.path)
        try:
            archive, prefix, raw = torch_save_pickle(self.fd, self.path, 0, self.size, where)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
            raise DataCheckError(f"{where}: not a readable torch.save zip ({str(error)[:80]}; truncated?)") from None
        storages = {}
        for info in archive.infolist():
            start = record_start(self.fd, self.path, 0, self.size, info, where)
            if info.filename.startswith(f"{prefix}data/"):
                storages[info.filename[len(f"{prefix}data/") :]] = StorageEntry(start, info.file_size, info.CRC)
        return unpickle(raw, where=f"{where} data.pkl"), storages

    def tensor_range(self, record: Any, what: str) -> TensorRange:
        """Where a contiguous tensor's elements lie in this file (checked inside its storage)."""
        where = f"{self.path}: {what}"
        if not isinstance(record, TensorRecord):
            raise DataCheckError(f"{where}: expected a tensor, found {type(record).__name__}")
        entry = self.storages.get(record.storage.key)
        if entry is None:
            raise DataCheckError(f"{where}: storage {record.storage.key!r} is missing from the zip")
        dtype, skip, _ = tensor_bytes(record, entry.nbytes, where)
        checked = entry.crc32 != 0 or entry.nbytes == 0  # 0: torch.save wrote none
        storage = StorageSpan(record.storage.key, entry.offset, entry.nbytes, entry.crc32) if checked else None
        return TensorRange(self.path, entry.offset + skip, numel(record.shape), dtype, storage)

    def crc_problems(self) -> tuple[int, list[str]]:
        """(storages checked against the zip's CRC-32, one line per mismatch)."""
        checks = self.crc_checks(0, self.size)
        return len(checks), [problem for _, problem in checks if problem is not None]

    def unrecorded_crcs(self) -> int:
        """The storages with bytes whose CRC-32 the zip records as 0 (torch.save with crc32 off): not checked."""
        return sum(1 for entry in self.storages.values() if entry.crc32 == 0 and entry.nbytes > 0)

    def crc_checks(self, begin: int, end: int) -> list[tuple[int, str | None]]:
        """Each storage whose data starts in bytes [begin, end) checked against the zip's CRC-32:
        (its place among the storages, the line when it does not match, else None)."""
        checks: list[tuple[int, str | None]] = []
        for place, (key, entry) in enumerate(self.storages.items()):
            if not begin <= entry.offset < end or (entry.crc32 == 0 and entry.nbytes > 0):
                continue
            value, stop = 0, entry.offset + entry.nbytes
            for position in range(entry.offset, stop, CRC_BLOCK):
                value = crc32(read_exactly(self.fd, min(CRC_BLOCK, stop - position), position, self.path), value)
            damaged = f"{self.path}: storage {key!r}: CRC-32 {value:08x}, the zip says {entry.crc32:08x} (damaged)"
            checks.append((place, None if value == entry.crc32 else damaged))
        return checks


def verify_saved_files(
    report: VerifyReport,
    directory: Path,
    sources: list[SourceTensor],
    opened: list[SaveFile],
    crcs: list[tuple[int, list[str]]] | None = None,
) -> VerifyReport:
    """`report` of the `torch.save` files `opened` holding `sources`: every storage against the
    zip's CRC-32 (`crcs`: each file's `crc_problems()`, found by the ranks of a spread verify, else
    here) and every tensor covered exactly once, in order; what a format checks besides (its
    files present, its records read) it adds to `report.checked` after these."""
    problems, storages = [], 0
    for source in sources:
        position = 0
        for piece in sorted(source.pieces_in(ElementRange(0, source.numel)), key=lambda p: p.range.start):
            if piece.range.start != position:
                what = "overlap" if piece.range.start < position else "gap"
                problems.append(f"{directory}: {source.name!r}: {what} at element {min(position, piece.range.start)}")
                break
            position = piece.range.end
        else:
            if position != source.numel:
                problems.append(f"{directory}: {source.name!r}: covered up to element {position} of {source.numel}")
    for count, found in crcs if crcs is not None else (rank_file.crc_problems() for rank_file in opened):
        storages += count
        problems.extend(found)
    unrecorded = sum(rank_file.unrecorded_crcs() for rank_file in opened)
    report.ok, report.problems, report.tensors, report.bytes = not problems, problems, len(sources), sum(s.nbytes for s in sources)
    report.counts = {"file": len(opened), "storage": storages}
    report.checked = [
        "every data.pkl through the allow-list unpickler",
        "every tensor inside its storage",
        f"{storages} storages against the zip's CRC-32",
    ]
    if unrecorded:
        report.not_checked.append(f"{unrecorded} storages whose zip records carry no CRC-32 (written with crc32 off)")
    return report
