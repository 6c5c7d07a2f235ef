"""The one writer of checkpoint files (no torch): safetensors files whose header is known before
their data (`names.layout_header`, or a rank file's `placement.FileLayout`), written front to
back in bounded memory. Small pieces are gathered in a 1 MiB buffer, so a file of many small
fragments costs a few system calls. `CacheMode` says how the data passes the page cache: DIRECT
(an 8 MiB page-aligned staging buffer, O_DIRECT) leaves the kernel no page-cache copy,
writeback or reclaim to do on the cores training uses. `close()` fsyncs unless the caller syncs
many files at once (`sync=False`, then `staging.sync_files`). On an exception inside a `with`
block the partial file is removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from ..core import workers
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.crc import PartRead, check_parts, crc32, crc32_combine
from ..core.files import Descriptor, copy_range, create
from ..core.names import layout_header, output_dtype
from .manifest import Manifest, save_manifest
from .names import rank_file_name
from .placement import FileLayout, Placement, ShardLayout, TensorSpec

WRITE_BEHIND_BYTES = 32 * 1024 * 1024
BUFFER_BYTES = 1024 * 1024
DIRECT_BUFFER_BYTES = 8 * 1024 * 1024  # a multiple of any filesystem's O_DIRECT alignment
DIRECT_MIN_BYTES = 2 * DIRECT_BUFFER_BYTES  # smaller files gain nothing from bypassing the cache
PIPE_BYTES = 1024 * 1024  # the pipe `send` splices through (Linux's default pipe-max-size)


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for an open file; False where the system or filesystem refuses it."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct if on else flags & ~direct)
    except OSError:
        return False
    return True


def _pipe() -> tuple[int, int, int]:
    """A pipe (read end, write end, size) of PIPE_BYTES, or of the system's default size where
    it allows no larger one."""
    read_end, write_end = os.pipe()
    try:
        size = fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):
        size = fcntl.fcntl(write_end, fcntl.F_GETPIPE_SZ) if hasattr(fcntl, "F_GETPIPE_SZ") else 64 * 1024
    return read_end, write_end, size


class CacheMode(Enum):
    """How a written file's data goes through the kernel's page cache."""

    CACHED = "cached"  # written back whenever the kernel likes
    # writeback started every WRITE_BEHIND_BYTES written, those pages then dropped; bytes copied by the
    # kernel (`send`) are left to the final sync: starting their writeback here cost more CPU and time
    # than the sync's writeback of them (docs/megatron.md)
    WRITE_BEHIND = "write-behind"
    DIRECT = "direct"  # O_DIRECT from an aligned staging buffer, no page cache (CACHED where the filesystem refuses it)


class _FileWriter:
    """A file of known size, written front to back: the header, then data in pieces."""

    def _open(self, path: str | Path, header: bytes, size: int, *, cache: CacheMode, sync: bool) -> None:
        self.path, self.size, self.sync = Path(path), size, sync
        self._written = self._buffered = 0
        self._flushed = 0  # bytes whose writeback was started (WRITE_BEHIND)
        self.write_seconds = self.fsync_seconds = 0.0
        self.direct_bytes = 0  # written with O_DIRECT, past the page cache
        self._fd = create(self.path)
        self._pipe: tuple[int, int, int] | None = None  # (read end, write end, size) of the pipe `send` splices through
        if cache is CacheMode.WRITE_BEHIND and not hasattr(os, "posix_fadvise"):
            cache = CacheMode.CACHED
        if cache is CacheMode.DIRECT and not (size >= DIRECT_MIN_BYTES and _set_direct(self._fd, True)):
            cache = CacheMode.CACHED
        self._mode = cache
        direct = cache is CacheMode.DIRECT
        self._buffer: bytearray | mmap.mmap = mmap.mmap(-1, DIRECT_BUFFER_BYTES) if direct else bytearray(min(BUFFER_BYTES, size))
        self.write(header)

    def write(self, data) -> None:
        """Append bytes (anything exposing the buffer protocol)."""
        view = data if isinstance(data, memoryview) and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        if self._written + self._buffered + view.nbytes > self.size:
            raise ValueError(f"{self.path}: writing past the {self.size} bytes the header announced")
        if self._mode is CacheMode.DIRECT:
            self._stage(view)
            return
        if self._buffered + view.nbytes > len(self._buffer):
            self._flush()
            if view.nbytes >= len(self._buffer):
                self._write_all(view)
                return
        self._buffer[self._buffered : self._buffered + view.nbytes] = view
        self._buffered += view.nbytes

    def send(self, source: Descriptor, offset: int, count: int) -> None:
        """Append bytes [offset, offset + count) of the open file `source`, copied by the kernel:
        they never pass through this process. They are spliced through a 1 MiB pipe of this
        writer's (copy_file_range splices through a 64 KiB one, which costs the kernel's copy
        more: docs/megatron.md); copy_range copies what cannot be spliced (an object, no
        splice(2)). A DIRECT file goes on cached."""
        if self._written + self._buffered + count > self.size:
            raise ValueError(f"{self.path}: writing past the {self.size} bytes the header announced")
        self._end_direct()
        self._flush()
        started = time.perf_counter()
        spliced = self._splice(source, offset, count)
        copy_range(source, offset + spliced, count - spliced, self._fd, self._written + spliced, self.path)
        self._written += count
        os.lseek(self._fd, self._written, os.SEEK_SET)  # copy_range writes at offsets; write() goes on from here
        self.write_seconds += time.perf_counter() - started
        self._flushed = self._written  # kernel copies are left to the final sync (CacheMode.WRITE_BEHIND)

    def _splice(self, source: Descriptor, offset: int, count: int) -> int:
        """Bytes [offset, offset + count) of file `source` spliced to the end of the written
        bytes, as many as splice(2) takes (0 where it is missing, for an object, or from the first
        error on); how many."""
        if not isinstance(source, int) or count == 0 or not hasattr(os, "splice"):
            return 0
        if self._pipe is None:
            self._pipe = _pipe()
        read_end, write_end, size = self._pipe
        done = 0
        try:
            while done < count:
                moved = os.splice(source, write_end, min(size, count - done), offset_src=offset + done)
                if moved == 0:  # the source ends early: copy_range says so
                    return done
                while moved:
                    put = os.splice(read_end, self._fd, moved, offset_dst=self._written + done)
                    done, moved = done + put, moved - put
        except OSError:  # what is left in the pipe goes with it; copy_range copies from `done` on
            self._close_pipe()
        return done

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            pipe, self._pipe = self._pipe, None
            os.close(pipe[0])
            os.close(pipe[1])

    def _stage(self, view: memoryview) -> None:
        """Direct mode: every byte goes through the staging buffer, which is written whole, so
        every write starts at a multiple of its (page-aligned) size. numpy copies without the GIL
        (imported here: the commands that never write past the page cache start without it)."""
        import numpy

        staging = numpy.frombuffer(self._buffer, dtype=numpy.uint8)
        source = numpy.frombuffer(view, dtype=numpy.uint8)
        taken = 0
        while taken < view.nbytes:
            count = min(len(staging) - self._buffered, view.nbytes - taken)
            staging[self._buffered : self._buffered + count] = source[taken : taken + count]
            self._buffered += count
            taken += count
            if self._buffered == len(staging):
                self._flush()

    def _end_direct(self) -> None:
        """Back to cached writes for what is not a whole staging buffer: the tail and header patches."""
        if self._mode is CacheMode.DIRECT:
            _set_direct(self._fd, False)
            self._mode = CacheMode.CACHED

    def _flush(self) -> None:
        if self._buffered:
            self._write_all(memoryview(self._buffer)[: self._buffered])
            self._buffered = 0

    def _write_all(self, view: memoryview) -> None:
        started = time.perf_counter()
        while view.nbytes:
            try:
                count = os.write(self._fd, view)
            except OSError as error:
                if error.errno == errno.EINVAL and self._mode is CacheMode.DIRECT:  # the filesystem took O_DIRECT's flag but not its writes
                    self._end_direct()
                    continue
                raise OSError(error.errno, error.strerror, str(self.path)) from None
            view = view[count:]
            self._written += count
            self.direct_bytes += count if self._mode is CacheMode.DIRECT else 0
        self.write_seconds += time.perf_counter() - started
        self._write_behind()

    def _write_behind(self) -> None:
        if self._mode is CacheMode.WRITE_BEHIND and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            os.posix_fadvise(self._fd, self._flushed, self._written - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._written

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written (the crc32 digits of a rank file's header)."""
        self._end_direct()
        if offset + len(data) <= self._written:
            if os.pwrite(self._fd, data, offset) != len(data):
                raise OSError(f"{self.path}: short write while patching the header")
        elif offset >= self._written:  # still in the buffer (a small file)
            self._buffer[offset - self._written : offset - self._written + len(data)] = data
        else:
            self._flush()
            self.patch(offset, data)

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self._end_direct()
            self._flush()
            if self._written != self.size:
                raise ValueError(f"{self.path}: wrote {self._written} bytes, the header announced {self.size}")
            if self.sync:
                started = time.perf_counter()
                os.fsync(self._fd)
                self.fsync_seconds += time.perf_counter() - started
        finally:
            self._release()

    def abort(self) -> None:
        self._release()
        self.path.unlink(missing_ok=True)

    def _release(self) -> None:
        self._close_pipe()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        if isinstance(self._buffer, mmap.mmap):
            with contextlib.suppress(BufferError):  # views of it in a traceback's frames: unmapped when they go
                self._buffer.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class StreamingWriter(_FileWriter):
    """One safetensors file: the data of each tensor of `order`, in that order, written in any
    number of pieces."""

    def __init__(
        self,
        path: str | Path,
        entries: list[tuple[str, str, tuple[int, ...]]],
        *,
        metadata: dict[str, str] | None = None,
        cache: CacheMode = CacheMode.CACHED,
        sync: bool = True,
    ):
        header, self.order = layout_header(entries, metadata)
        self._open(path, header, len(header) + sum(info.nbytes for _, info in self.order), cache=cache, sync=sync)


class RankFileWriter(_FileWriter):
    """One v2 rank file laid out by `layout`: each fragment's bytes in data order, then
    `end_fragment(crc32)`; `close` writes the crc32 hex digits into the header (fixed width, so
    its length never changes)."""

    def __init__(self, path: str | Path, layout: FileLayout, *, cache: CacheMode = CacheMode.CACHED, sync: bool = True):
        self.layout = layout
        self._crcs: list[int] = []
        self._open(path, layout.header, layout.size, cache=cache, sync=sync)

    def end_fragment(self, crc32: int) -> None:
        index = len(self._crcs)
        if index >= len(self.layout.fragments):
            raise ValueError(f"{self.path}: more fragments than the {len(self.layout.fragments)} its layout holds")
        end = self.layout.data_start + self.layout.spans[index][1]
        if self._written + self._buffered != end:
            raise ValueError(f"{self.path}: fragment {index} ends at byte {self._written + self._buffered}, its layout at {end}")
        self._crcs.append(crc32)

    def close(self) -> None:
        if self._fd >= 0 and len(self._crcs) != len(self.layout.fragments):
            self.abort()
            raise ValueError(f"{self.path}: {len(self._crcs)} of {len(self.layout.fragments)} fragments written")
        if self._fd >= 0 and self._crcs:
            self.patch(self.layout.crc_offset, self.layout.header_with(self._crcs)[1])
        super().close()

    def file_crc32(self) -> int:
        """The crc32 of the whole file as written: its header's, combined with each fragment's
        (the fragments lie back to back after it), so nothing is read again."""
        crc = crc32(b"".join(self.layout.header_with(self._crcs)))
        for (start, end), fragment_crc in zip(self.layout.spans, self._crcs, strict=True):
            crc = crc32_combine(crc, fragment_crc, end - start)
        return crc


@dataclass(frozen=True)
class WrittenCheckpoint:
    manifest: Manifest
    files: list[str]  # the rank files
    bytes: int  # the tensors' bytes, as verify and inspect count them (the files add headers)


def write_sharded(
    directory: Path,
    *,
    sources: list[SourceTensor],
    placement: Placement,
    world_size: int,
    strategy: str,
    training_state: dict,
    aliases: dict[str, str],
    cast_to: str | None,
    chunk_size: int,
    progress: Callable[[int], None] | None = None,
) -> WrittenCheckpoint:
    """A whole sharded checkpoint (v2) in `directory`: every rank file (possibly with no tensors),
    copied from `sources` by the byte engine, then manifest.json; the caller syncs them all."""
    tensors = tuple(TensorSpec(s.name, output_dtype(s.dtype, cast_to), tuple(s.shape)) for s in sources)
    manifest = Manifest(world_size, strategy, placement, tensors, dict(aliases), dict(training_state))
    write_rank_files(directory, manifest.layout(), sources, [t.dtype for t in tensors], chunk_size=chunk_size, progress=progress)
    save_manifest(directory, manifest)
    files = [rank_file_name(rank, world_size) for rank in range(world_size)]
    return WrittenCheckpoint(manifest, files, sum(t.nbytes for t in manifest.tensors))


def write_rank_files(
    directory: Path,
    layout: ShardLayout,
    sources: Sequence[SourceTensor],
    out_dtypes: list[str],
    *,
    chunk_size: int,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Every rank file of `layout` in `directory`, by `process_count` processes."""
    count = workers.process_count(layout.world_size)
    cuts = [layout.world_size * share // count for share in range(count + 1)]

    def write(ranks: range, report: Callable[[int], None] | None) -> list[PartRead]:
        engine = ByteEngine(sources, out_dtypes, chunk_size=chunk_size, progress=report)
        try:
            for rank in ranks:
                engine.write_rank_file(directory / rank_file_name(rank, layout.world_size), layout.file_layout(rank))
        finally:
            engine.close()
        return engine.finish_parts()

    results = workers.in_processes([range(cuts[share], cuts[share + 1]) for share in range(count)], write, progress)
    check_parts([part for parts in results for part in parts])
