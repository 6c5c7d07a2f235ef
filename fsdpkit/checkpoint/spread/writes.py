"""One part of an output file written in place (no torch): bytes [begin, end) of a file that
several processes may write at once, each its own range, front to back through a 1 MiB buffer
(a block of DIRECT_BYTES or more is written as it comes, uncopied), with the crc32 of what it
wrote. Every WRITE_BEHIND_BYTES written, a thread of the part's starts the writeback of those
bytes (and drops their pages once written), as the one-process writer does in its own thread:
the disk writes the part while it is cast, so that the fsync that records it finds little left
to write (the rank's last part's fsync is in its wall time), and the writeback's system time
is not spent by the thread that casts. The file is created by whichever part comes first and never truncated (a part written
again after a crash overwrites its own range). `StreamSink` takes the same bytes, front to back,
into a storage's write stream (an object, no local file)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..core.crc import crc32
from ..storage.face import WriteStream

BUFFER_BYTES = 1 << 20
DIRECT_BYTES = 1 << 17
WRITE_BEHIND_BYTES = 16 << 20


class PartSink:
    def __init__(self, path: Path, begin: int, end: int):
        self.path, self.at, self.end = path, begin, end
        self.crc = 0
        self._buffer = bytearray(BUFFER_BYTES)
        self._buffered = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._behind_from = begin  # the bytes before this have had their writeback started
        self._behind: ThreadPoolExecutor | None = None  # the thread that starts it, made for a part that needs it

    def write(self, data) -> None:
        view = data if isinstance(data, memoryview) and data.format == "B" else memoryview(data).cast("B")
        if not view.nbytes:
            return
        if self.at + self._buffered + view.nbytes > self.end:
            raise ValueError(f"{self.path}: writing past byte {self.end}, the end of this part")
        self.crc = crc32(view, self.crc)
        if view.nbytes >= DIRECT_BYTES or self._buffered + view.nbytes > len(self._buffer):
            self._flush()
            if view.nbytes >= DIRECT_BYTES:
                self._pwrite(view)
                return
        self._buffer[self._buffered : self._buffered + view.nbytes] = view
        self._buffered += view.nbytes

    def _flush(self) -> None:
        if self._buffered:
            self._pwrite(memoryview(self._buffer)[: self._buffered])
            self._buffered = 0

    def _pwrite(self, view: memoryview) -> None:
        while view.nbytes:
            count = os.pwrite(self._fd, view, self.at)
            view, self.at = view[count:], self.at + count
        if self.at - self._behind_from >= WRITE_BEHIND_BYTES and hasattr(os, "posix_fadvise"):
            if self._behind is None:
                self._behind = ThreadPoolExecutor(1, thread_name_prefix="fsdpkit-write-behind")
            self._behind.submit(_write_behind, self._fd, self._behind_from, self.at - self._behind_from)
            self._behind_from = self.at

    def __enter__(self) -> PartSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._flush()
                if self.at != self.end:
                    raise ValueError(f"{self.path}: part ends at byte {self.at}, expected {self.end}")
        finally:
            if self._behind is not None:
                self._behind.shutdown(wait=True)  # before its descriptor closes
            os.close(self._fd)


def _write_behind(fd: int, offset: int, count: int) -> None:
    """Start the writeback of bytes [offset, offset + count) of `fd`, and drop those of its pages
    already written (advice: the fsync that records the part makes it durable either way)."""
    try:
        os.posix_fadvise(fd, offset, count, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


class StreamSink:
    """Bytes [begin, end) of an output file written front to back into a storage's write
    stream (a multipart upload into an object store: no local copy), through a 1 MiB buffer
    for the small writes (archive headers, bytes items), with the crc32 of what it wrote: the
    sink of a part that `PartSink` writes in place, where the file is an object."""

    def __init__(self, stream: WriteStream, where: str, begin: int, end: int):
        self.path, self.at, self.end = where, begin, end
        self.crc = 0
        self._stream = stream
        self._buffer = bytearray()

    def write(self, data) -> None:
        view = data if isinstance(data, memoryview) and data.format == "B" else memoryview(data).cast("B")
        if not view.nbytes:
            return
        if self.at + len(self._buffer) + view.nbytes > self.end:
            raise ValueError(f"{self.path}: writing past byte {self.end}, the end of this part")
        self.crc = crc32(view, self.crc)
        if len(self._buffer) + view.nbytes > BUFFER_BYTES:
            self._flush()
            if view.nbytes >= BUFFER_BYTES:
                self._stream.write(view)
                self.at += view.nbytes
                return
        self._buffer += view

    def _flush(self) -> None:
        if self._buffer:
            self._stream.write(bytes(self._buffer))
            self.at += len(self._buffer)
            self._buffer.clear()

    def __enter__(self) -> StreamSink:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._flush()
            if self.at != self.end:
                raise ValueError(f"{self.path}: part ends at byte {self.at}, expected {self.end}")
