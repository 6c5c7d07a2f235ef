"""Checkpoint files at the system-call level (no torch): the one way a file is opened for
reading (`open_regular`: without blocking, so a FIFO in place of a file cannot hang, and
only a regular file accepted), exact reads, vectored writes, and source files mapped in
bounded windows (`MappedFiles`) for the byte engine.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
from collections import OrderedDict
from pathlib import Path

from ..errors import DataCheckError

WINDOW_BYTES = 512 << 10  # a mapping covers two such blocks, so any block of at most one fits in one mapping
MAX_WINDOWS = 96  # mappings kept: at most 2 * MAX_WINDOWS * WINDOW_BYTES of mapped pages
MAX_OPEN_FILES = 64
WRITE_BEHIND_BYTES = 32 * 1024 * 1024  # the writeback of every such step of an output starts at once
IOV_MAX = 1024  # buffers per writev (Linux's limit)


def open_regular(path: Path) -> tuple[int, int]:
    """(fd, size) of a regular file opened read-only without blocking, else a DataCheckError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataCheckError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise DataCheckError(f"{path}: is a directory, expected a file") from None
    except OSError as error:
        raise DataCheckError(f"{path}: cannot read ({error.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise DataCheckError(f"{path}: not a regular file")
    return fd, info.st_size


def read_regular(path: Path, limit: int) -> bytes:
    """The start of regular file `path`, at most `limit` bytes (a DataCheckError otherwise)."""
    fd, size = open_regular(path)
    try:
        return read_exactly(fd, min(size, limit), 0, path)
    finally:
        os.close(fd)


def read_exactly(fd: int, count: int, offset: int, path: Path) -> bytes:
    data = os.pread(fd, count, offset)
    while len(data) < count:
        more = os.pread(fd, count - len(data), offset + len(data))
        if not more:
            raise DataCheckError(f"{path}: file ends at byte {offset + len(data)}, {count - len(data)} bytes early (truncated)")
        data += more
    return data


def pread_into(fd: int, offset: int, view: memoryview, path: Path) -> None:
    """Fill `view` from byte `offset` of `fd`."""
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise DataCheckError(f"{path}: file ends at byte {offset + done}, {view.nbytes - done} bytes early (truncated)")
        done += count


def write_views(fd: int, views: list, path: Path) -> None:
    """Write every byte of `views` (bytes-like objects) at the file position, IOV_MAX at a time."""
    for first in range(0, len(views), IOV_MAX):
        batch = views[first : first + IOV_MAX]
        left = sum(map(len, batch))
        while left:
            try:
                count = os.writev(fd, batch)
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
            if count == 0:
                raise OSError(errno.EIO, "write made no progress", str(path))
            left -= count
            while left and count >= len(batch[0]):
                count -= len(batch.pop(0))
            if left and count:
                batch[0] = memoryview(batch[0])[count:]


def write_behind(fd: int, flushed: int) -> int:
    """Start the writeback of what `fd` got since byte `flushed` once that reaches
    WRITE_BEHIND_BYTES (dirty pages are never dropped), so the disk works while the copy goes
    on and a large output does not fill the page cache; returns the new mark."""
    position = os.lseek(fd, 0, os.SEEK_CUR)
    if position - flushed >= WRITE_BEHIND_BYTES and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, flushed, position - flushed, os.POSIX_FADV_DONTNEED)
        return position
    return flushed


class MappedFiles:
    """Source files by number: descriptors (an LRU) and read-only windows mapped from them (an
    LRU; a window is unmapped when no slice of it is left)."""

    def __init__(self) -> None:
        self._numbers: dict[Path, int] = {}
        self.paths: list[Path] = []
        self.sizes: list[int] = []
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], memoryview] = OrderedDict()

    def number(self, path: Path) -> int:
        number = self._numbers.get(path)
        if number is None:
            fd, size = open_regular(path)
            number = self._numbers[path] = len(self.paths)
            self.paths.append(path)
            self.sizes.append(size)
            self._fds[number] = fd
            self._trim_fds()
        return number

    def fd(self, number: int) -> int:
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = open_regular(self.paths[number])[0]
            self._trim_fds()
        else:
            self._fds.move_to_end(number)
        return fd

    def window(self, number: int, offset: int) -> tuple[int, memoryview]:
        """(file offset where it starts, the mapping) of a window holding at least bytes
        [offset, offset + WINDOW_BYTES) of file `number`, or up to its end."""
        block = offset // WINDOW_BYTES
        key = (number, block)
        view = self._windows.get(key)
        if view is None:
            start = block * WINDOW_BYTES
            length = min(2 * WINDOW_BYTES, self.sizes[number] - start)
            view = self._windows[key] = memoryview(mmap.mmap(self.fd(number), length, access=mmap.ACCESS_READ, offset=start))
            if len(self._windows) > MAX_WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return block * WINDOW_BYTES, view

    def release(self, number: int, start: int, view: memoryview) -> None:
        """Forget the window at `start` (a reader has passed it), unless it has been replaced."""
        key = (number, start // WINDOW_BYTES)
        if self._windows.get(key) is view:
            del self._windows[key]

    def _trim_fds(self) -> None:
        while len(self._fds) > MAX_OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])

    def close(self) -> None:
        self._windows.clear()
        while self._fds:
            os.close(self._fds.popitem()[1])
