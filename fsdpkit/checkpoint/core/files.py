"""Checkpoint files at the system-call level (no torch), the one module that reads their bytes:
the one way a file is opened for reading (`open_regular`: without blocking, so a FIFO in place
of a file cannot hang, and only a regular file accepted), exact reads, vectored writes, source
files mapped in bounded windows (`MappedFiles`), and writes run by worker threads
(`WriteQueue`), so the kernel copies on one core while the byte engine checksums on the other.

A source path may be a `StoredPath` (a checkpoint in a bucket, read in place): it opens as an
`ObjectHandle`, whose bytes come through the storage face (ranged reads; the byte engine's
windows from streamed GETs in offset order) where a local file's come from `pread` and mappings.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import cast

from ...errors import DataCheckError
from ..storage.handle import ObjectHandle
from ..storage.stored_path import StoredPath
from .crc import crc32

CRC_BLOCK_BYTES = 8 << 20  # bytes `crc32_of_range` maps or reads at a time
Descriptor = int | ObjectHandle  # a file descriptor, or an object of a storage read through the face

WINDOW_BYTES = 512 << 10  # a mapping covers two such blocks, so any block of at most one fits in one mapping
MAX_WINDOWS = 96  # mappings kept: at most 2 * MAX_WINDOWS * WINDOW_BYTES of mapped pages
MAX_OPEN_FILES = 64
IOV_MAX = 1024  # buffers per writev (Linux's limit)
WRITE_THREADS = 2  # output files written at once
IN_FLIGHT_BYTES = 64 << 20  # views queued to be written (they keep source mappings alive)
QUEUED_WRITES = 256  # each kernel copy holds a duplicate of its source's descriptor
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


def source_path(location: str | os.PathLike[str] | StoredPath) -> Path:
    """The path a reader takes: a `StoredPath` as it is (typed as the `Path` it stands in for),
    anything else as a local `Path`."""
    return cast(Path, location) if isinstance(location, StoredPath) else Path(location)


def open_regular(path: Path) -> tuple[Descriptor, int]:
    """(fd, size) of a regular file opened read-only without blocking, else a DataCheckError;
    (handle, size) of an object of a storage (a `StoredPath`)."""
    if isinstance(path, StoredPath):
        return path.handle()
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


def close(fd: Descriptor) -> None:
    """Close a file descriptor, or end an object handle's stream."""
    if isinstance(fd, int):
        os.close(fd)
    else:
        fd.close()


@contextlib.contextmanager
def regular_file(path: Path) -> Iterator[tuple[Descriptor, int]]:
    fd, size = open_regular(path)
    try:
        yield fd, size
    finally:
        close(fd)


def read_regular(path: Path, limit: int | None = None) -> bytes:
    """Regular file `path` (a DataCheckError otherwise), its first `limit` bytes where given."""
    with regular_file(path) as (fd, size):
        return read_exactly(fd, size if limit is None else min(size, limit), 0, path)


def read_blocks(path: Path, buffer: memoryview, start: int = 0, end: int | None = None) -> Iterator[memoryview]:
    """Bytes [start, end) of regular file `path` (to its end without `end`), front to back, read
    into `buffer` one block at a time (an object's, as the face's stream gives them); each block is
    valid until the next is read."""
    if isinstance(path, StoredPath):
        end = path.stat().st_size if end is None else end
        yield from (block for _, block in path.storage.read_blocks(path.key, [(start, end)], block_bytes=len(buffer)))
        return
    with regular_file(path) as (fd, size):
        end = size if end is None else end
        while start < end:
            block = buffer[: min(len(buffer), end - start)]
            pread_into(fd, start, block, path)
            yield block
            start += len(block)


def _pread(fd: Descriptor, count: int, offset: int) -> bytes:
    return os.pread(fd, count, offset) if isinstance(fd, int) else fd.pread(count, offset)


def prefetch(fd: Descriptor, offsets: list[int], nbytes: int) -> None:
    """An object's bytes [offset, offset + nbytes) at each of `offsets`, about to be read in
    small reads, fetched at once (`ObjectHandle.prefetch`); nothing for a local file."""
    if not isinstance(fd, int):
        fd.prefetch(offsets, nbytes)


def read_exactly(fd: Descriptor, count: int, offset: int, path: str | Path) -> bytes:
    """Bytes [offset, offset + count) of `fd`; a file that ends before is a DataCheckError."""
    data = _pread(fd, count, offset)
    while len(data) < count:
        more = _pread(fd, count - len(data), offset + len(data))
        if not more:
            raise DataCheckError(f"{path}: file ends at byte {offset + len(data)}, {count - len(data)} bytes early (truncated)")
        data += more
    return data


def read_some(fd: Descriptor, offset: int, view: memoryview) -> int:
    """Read what one call gives, at most `view`'s bytes, from byte `offset` of `fd` into `view`:
    how many (0 at the end of the file)."""
    if isinstance(fd, int):
        return os.preadv(fd, [view], offset)
    data = fd.pread(len(view), offset)
    view[: len(data)] = data
    return len(data)


def pread_into(fd: Descriptor, offset: int, view: memoryview, path: Path) -> None:
    done = 0
    while done < view.nbytes:
        count = read_some(fd, offset + done, view[done:])
        if count == 0:
            raise DataCheckError(f"{path}: file ends at byte {offset + done}, {view.nbytes - done} bytes early (truncated)")
        done += count


def write_views(fd: int, views: list, path: Path, offset: int = -1) -> None:
    """Write every byte of `views` (bytes-like objects) at `offset`, else at the file position,
    IOV_MAX at a time."""
    for first in range(0, len(views), IOV_MAX):
        batch = views[first : first + IOV_MAX]
        left = sum(map(len, batch))
        while left:
            try:
                count = os.writev(fd, batch) if offset < 0 else os.pwritev(fd, batch, offset)
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(path)) from None
            if count == 0:
                raise OSError(errno.EIO, "write made no progress", str(path))
            left -= count
            offset += count if offset >= 0 else 0
            while left and count >= len(batch[0]):
                count -= len(batch.pop(0))
            if left and count:
                batch[0] = memoryview(batch[0])[count:]


def create(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)


def replace_file(path: Path, data: bytes, tmp: Path) -> None:
    """Replace `path` atomically by a file holding `data`: written to `tmp`, fsynced, renamed."""
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_file(path: Path, views: list) -> None:
    """File `path` holding the bytes of `views`; removed on an error."""
    fd = create(path)
    try:
        write_views(fd, views, path)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def crc32_of_range(source: Descriptor, offset: int, count: int, crc: int, path: Path) -> int:
    """`crc` continued over bytes [offset, offset + count) of `source`, CRC_BLOCK_BYTES at a time: a
    local file's mapped (no copy: right after `copy_range`, they are in the page cache; a mapping
    at a time, since the pages mapped count in the process's resident memory), an object's read."""
    for at in range(offset, offset + count, CRC_BLOCK_BYTES):
        size = min(CRC_BLOCK_BYTES, offset + count - at)
        if not isinstance(source, int):
            crc = crc32(read_exactly(source, size, at, path), crc)
            continue
        start = at - at % mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(source, at + size - start, access=mmap.ACCESS_READ, offset=start) as mapped, memoryview(mapped) as view:
            with view[at - start :] as wanted:
                crc = crc32(wanted, crc)
    return crc


def copy_range(source: Descriptor, offset: int, count: int, fd: int, out_offset: int, path: Path) -> None:
    """Bytes [offset, offset + count) of file `source` to `out_offset` of `fd`: the kernel copies
    them (copy_file_range), else, where this kernel or filesystem pair refuses or `source` is an
    object, read and write."""
    if not isinstance(source, int):
        for at in range(offset, offset + count, 8 << 20):
            data = read_exactly(source, min(8 << 20, offset + count - at), at, path)
            write_views(fd, [data], path, out_offset + at - offset)
        return
    kernel = hasattr(os, "copy_file_range")
    while count:
        try:
            if kernel:
                done = os.copy_file_range(source, fd, count, offset, out_offset)
            else:
                done = os.pwrite(fd, os.pread(source, min(count, 8 << 20), offset), out_offset)
        except OSError as error:
            if error.errno in _NO_KERNEL_COPY and kernel:
                kernel = False
                continue
            raise OSError(error.errno, error.strerror, str(path)) from None
        if done == 0:
            raise DataCheckError(f"{path}: its source ends at byte {offset} (truncated while copied)")
        offset, out_offset, count = offset + done, out_offset + done, count - done


class WriteQueue:
    """Writes run by WRITE_THREADS worker threads, each at its own offsets: a file's writes go
    to one thread (its lane) and run in the order submitted, while other lanes write other
    files (ext4 lets one writer into a file at a time). At most IN_FLIGHT_BYTES of written
    views (they keep source mappings alive) and QUEUED_WRITES writes wait. `open` makes a file
    that `seal` fsyncs and closes after its writes; `copy` holds a duplicate of its source's
    descriptor until done. The first failed write is raised by the next `submit` or by
    `close`, which waits for all and closes every descriptor still open."""

    def __init__(self) -> None:
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix="fsdpkit-write") for _ in range(WRITE_THREADS)]
        self._queued: deque[tuple[Future, int]] = deque()  # (write, bytes of views it holds)
        self._in_flight = 0
        self._open: set[int] = set()

    def open(self, path: Path) -> int:
        fd = create(path)
        self._open.add(fd)
        return fd

    def submit(self, lane: int, nbytes: int, function, *args) -> None:
        self._retire(self._in_flight + nbytes - IN_FLIGHT_BYTES)
        self._queued.append((self._lanes[lane % WRITE_THREADS].submit(function, *args), nbytes))
        self._in_flight += nbytes

    def copy(self, lane: int, source: int, offset: int, count: int, fd: int, out_offset: int, path: Path) -> None:
        duplicate = os.dup(source)  # the caller may close `source` before the copy runs
        self._open.add(duplicate)
        self.submit(lane, 0, self._copy, duplicate, offset, count, fd, out_offset, path)

    def _copy(self, source: int, *args) -> None:
        try:
            copy_range(source, *args)
        finally:
            self._close(source, sync=False)

    def seal(self, lane: int, fd: int) -> None:
        self.submit(lane, 0, self._close, fd, True)

    def _close(self, fd: int, sync: bool) -> None:
        try:
            if sync:
                os.fsync(fd)
        finally:
            self._open.discard(fd)
            os.close(fd)

    def _retire(self, excess: int) -> None:
        """Finish queued writes from the oldest on: those done, and more while `excess` > 0 or
        too many wait."""
        while self._queued and (excess > 0 or len(self._queued) >= QUEUED_WRITES or self._queued[0][0].done()):
            future, nbytes = self._queued.popleft()
            self._in_flight -= nbytes
            excess -= nbytes
            future.result()

    def close(self) -> None:
        try:
            self._retire(1 << 62)
        finally:
            for future, _ in self._queued:
                future.cancel()
            for lane in self._lanes:
                lane.shutdown(wait=True)
            self._queued.clear()
            while self._open:
                os.close(self._open.pop())


class MappedFiles:
    """Source files by number: descriptors (an LRU) and read-only windows mapped from them (an
    LRU; a window is unmapped when no slice of it is left)."""

    def __init__(self) -> None:
        self._numbers: dict[Path, int] = {}
        self.paths: list[Path] = []
        self.sizes: list[int] = []
        self._fds: OrderedDict[int, Descriptor] = OrderedDict()
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

    def fd(self, number: int) -> Descriptor:
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = open_regular(self.paths[number])[0]
            self._trim_fds()
        else:
            self._fds.move_to_end(number)
        return fd

    def window(self, number: int, offset: int, until: int) -> tuple[int, memoryview]:
        """(file offset where it starts, the mapping) of a window holding at least bytes
        [offset, offset + WINDOW_BYTES) of file `number`, or up to its end; of an object, up to
        `until` (where the read ends) at most, from a streamed GET that ends there."""
        fd = self.fd(number)
        if not isinstance(fd, int):
            return offset, memoryview(fd.window(offset, 2 * WINDOW_BYTES, until))
        block = offset // WINDOW_BYTES
        key = (number, block)
        view = self._windows.get(key)
        if view is None:
            start = block * WINDOW_BYTES
            length = min(2 * WINDOW_BYTES, self.sizes[number] - start)
            view = self._windows[key] = memoryview(mmap.mmap(fd, length, access=mmap.ACCESS_READ, offset=start))
            if len(self._windows) > MAX_WINDOWS:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        return block * WINDOW_BYTES, view

    def read_ahead(self, runs: dict[int, list[tuple[int, int]]]) -> None:
        """Fetch byte runs [start, end) (sorted, disjoint) of the objects among files `runs` names
        (by number), dropping the runs fetched before; a local file's are mapped when read."""
        for fd in self._fds.values():
            if not isinstance(fd, int):
                fd.drop_ahead()
        for number, spans in runs.items():
            fd = self.fd(number)
            if not isinstance(fd, int):
                fd.read_ahead(spans)

    def release(self, number: int, start: int, view: memoryview) -> None:
        """Forget the window at `start` (a reader has passed it), unless it has been replaced."""
        key = (number, start // WINDOW_BYTES)
        if self._windows.get(key) is view:
            del self._windows[key]

    def _trim_fds(self) -> None:
        while len(self._fds) > MAX_OPEN_FILES:
            close(self._fds.popitem(last=False)[1])

    def close(self) -> None:
        self._windows.clear()
        while self._fds:
            close(self._fds.popitem()[1])
