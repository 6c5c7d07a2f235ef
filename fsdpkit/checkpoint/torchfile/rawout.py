"""One output file written from raw byte ranges of source files (no torch, no tensors): large
pieces without a checksum are copied by the kernel (`files.copy_range`), and where the file
records their CRC-32 (`start_crc` .. `crc`: a zip record's data) summed after from the source
(`files.crc32_of_range`: mapped); small ones, and those with a crc32 (read through the byte
engine, which checks them), gather into one `writev` of at most `BUFFER_BYTES`, so memory stays
a few MB whatever the checkpoint's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.crc import crc32
from ..core.files import IOV_MAX, Descriptor, close, copy_range, crc32_of_range, create, open_regular, read_exactly, write_views

BUFFER_BYTES = 8 * 1024 * 1024
KERNEL_COPY_BYTES = 64 * 1024  # byte ranges at least this large are copied by the kernel


class ByteOutput(Protocol):
    """What a file's contents are appended to: a `RawOutput`, or a byte range of a file written in parts."""

    position: int

    @property
    def path(self) -> Path | str:
        """For messages: the file, or the object's URL."""
        ...

    def write(self, data: bytes | bytearray | memoryview) -> None: ...

    def copy(self, source: SourceTensor, wanted: ElementRange) -> None: ...

    def copy_via_engine(self, source: SourceTensor, wanted: ElementRange, dtype: str) -> None: ...

    def start_crc(self) -> None:
        """Keep the CRC-32 of the bytes appended from here on."""
        ...

    def crc(self) -> int:
        """The CRC-32 of the bytes appended since `start_crc` (as far as this output holds them)."""
        ...


class RawOutput:
    def __init__(self, path: Path, engine: ByteEngine, progress: Callable[[int], None] | None = None):
        self.path, self.position = path, 0
        self._engine, self._progress = engine, progress
        self._fd = create(path)
        self._pending: list[bytes | bytearray | memoryview] = []  # written by one writev
        self._pending_bytes = 0
        self._sources: dict[Path, Descriptor] = {}
        self._crc: int | None = None  # None: not kept

    def __enter__(self) -> RawOutput:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        try:
            if kind is None:
                self._flush()
        finally:
            os.close(self._fd)
            while self._sources:
                close(self._sources.popitem()[1])
            if kind is not None:
                self.path.unlink(missing_ok=True)

    def start_crc(self) -> None:
        self._crc = 0

    def crc(self) -> int:
        value, self._crc = self._crc, None
        if value is None:
            raise AssertionError(f"{self.path}: crc() without start_crc()")
        return value

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._crc is not None:
            self._crc = crc32(data, self._crc)
        self._pending.append(data)
        self._pending_bytes += len(data)
        self.position += len(data)
        if self._pending_bytes >= BUFFER_BYTES or len(self._pending) >= IOV_MAX:
            self._flush()

    def copy(self, source: SourceTensor, wanted: ElementRange) -> None:
        """Append the bytes of elements `wanted` of `source`."""
        itemsize, done = dtype_info(source.dtype).itemsize, 0
        for piece in source.pieces_in(wanted):
            part = piece.range.intersect(wanted)
            if part.start != wanted.start + done:
                raise AssertionError(f"{source.name}: no source piece holds element {wanted.start + done}")
            nbytes = part.size * itemsize
            if piece.checked:
                self.copy_via_engine(source, part, source.dtype)
            else:
                offset = piece.offset + (part.start - piece.range.start) * itemsize
                self._raw(piece.path, offset, nbytes)
            done += part.size
            if self._progress is not None:
                self._progress(nbytes)
        if done != wanted.size:
            raise AssertionError(f"{source.name}: source pieces end at element {wanted.start + done}, not {wanted.end}")

    def copy_via_engine(self, source: SourceTensor, wanted: ElementRange, dtype: str) -> None:
        """Append elements `wanted` of `source` as `dtype`, read through the byte engine (which checks crc32s)."""
        for data in self._engine.checked_blocks(source, wanted, dtype, BUFFER_BYTES):
            self.write(data)

    def _raw(self, path: Path, offset: int, nbytes: int) -> None:
        fd = self._sources.get(path)
        if fd is None:
            fd = self._sources[path] = open_regular(path)[0]
        if nbytes < KERNEL_COPY_BYTES:
            self.write(read_exactly(fd, nbytes, offset, path))
            return
        self._flush()
        copy_range(fd, offset, nbytes, self._fd, self.position, path)
        self.position += nbytes
        if self._crc is not None:  # the bytes copied, summed from the source
            self._crc = crc32_of_range(fd, offset, nbytes, self._crc, path)

    def _flush(self) -> None:
        write_views(self._fd, self._pending, self.path, self.position - self._pending_bytes)  # explicit offsets throughout
        self._pending.clear()
        self._pending_bytes = 0
