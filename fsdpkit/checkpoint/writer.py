"""The one writer of checkpoint files (no torch): safetensors files whose header is known before
their data, streamed in bounded memory. Used by training saves (each rank its own file),
convert and reshard (every rank file of a new layout, `write_sharded`) and `convert --to
full` (`StreamingWriter`).

`StreamingWriter(path, entries, metadata=...)` lays the header out from (name, dtype, shape)
alone: entries in the order given after a stable sort by descending itemsize (so every tensor
starts aligned to its element size), header padded with spaces to a multiple of 8, as the
safetensors library does; the result reads back with `safetensors.safe_open`.
`RankFileWriter(path, file_layout)` writes a v2 rank file whose header the manifest derives
(`placement.FileLayout`); after each fragment the caller gives its crc32 (`end_fragment`),
and `close` writes the crc32 hex digits into the header's `__metadata__` (fixed width, so the
header's length never changes).

Data arrives in any number of pieces; small ones are gathered in a 1 MiB buffer so a file of
many small fragments costs a few system calls. `write_behind=True` starts the writeback of
every completed `WRITE_BEHIND_BYTES` at once (`posix_fadvise(DONTNEED)`: dirty data is never
dropped), so the disk works while the copy goes on and a multi-GB output does not fill the
page cache. `close()` fsyncs unless the caller syncs many files at once (`sync=False`, then
`storage.sync_files`, as `staged_output` does); `write_seconds` and `fsync_seconds` count the
time spent in those system calls. On an exception inside a `with` block the
partial file is removed. `write_sharded` spreads thousands of rank files over processes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..layout import ElementRange
from .bytecopy import ByteCopier, PartialCrc, SourceTensor, check_partial_crcs
from .format import dtype_info, numel, output_dtype, rank_file_name
from .manifest import Manifest, save_manifest
from .placement import FileLayout, Placement, TensorSpec

WRITE_BEHIND_BYTES = 32 * 1024 * 1024
BUFFER_BYTES = 1024 * 1024
WORKERS_FROM_FILES = 256  # write_sharded uses several processes from this many rank files on
MAX_WORKERS = 8


@dataclass(frozen=True)
class Span:
    """Where one entry's data sits, relative to the start of the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def layout_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[str, Span]]]:
    """The header bytes (length prefix included, padded to 8) and each entry's data span, in write order."""
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError(f"duplicate or reserved tensor names in one safetensors file: {names}")
    ordered = sorted(entries, key=lambda e: -dtype_info(e[1]).itemsize)  # stable: keeps caller order within a size
    document: dict[str, object] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    spans, position = [], 0
    for name, dtype, shape in ordered:
        size = numel(shape) * dtype_info(dtype).itemsize
        info = Span(dtype, tuple(int(d) for d in shape), position, position + size)
        document[name] = {"dtype": dtype, "shape": list(info.shape), "data_offsets": [info.begin, info.end]}
        spans.append((name, info))
        position += size
    raw = json.dumps(document, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


class _FileWriter:
    """A file of known size, written front to back: the header, then data in pieces."""

    def _open(self, path: str | Path, header: bytes, size: int, *, write_behind: bool, sync: bool) -> None:
        self.path, self.size, self.sync = Path(path), size, sync
        self._written = 0
        self._flushed = 0  # bytes whose writeback was started (write_behind)
        self._write_behind = write_behind and hasattr(os, "posix_fadvise")
        self._buffer = bytearray(min(BUFFER_BYTES, size))
        self._buffered = 0
        self.write_seconds = 0.0
        self.fsync_seconds = 0.0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.write(header)

    def write(self, data) -> None:
        """Append bytes (anything exposing the buffer protocol)."""
        view = data if isinstance(data, memoryview) and data.format == "B" and data.ndim == 1 else memoryview(data).cast("B")
        if self._written + self._buffered + view.nbytes > self.size:
            raise ValueError(f"{self.path}: writing past the {self.size} bytes the header announced")
        if self._buffered + view.nbytes <= len(self._buffer):
            self._buffer[self._buffered:self._buffered + view.nbytes] = view
            self._buffered += view.nbytes
            return
        self._flush()
        if view.nbytes < len(self._buffer):
            self._buffer[:view.nbytes] = view
            self._buffered = view.nbytes
        else:
            self._write_all(view)

    def _flush(self) -> None:
        if self._buffered:
            self._write_all(memoryview(self._buffer)[:self._buffered])
            self._buffered = 0

    def _write_all(self, view: memoryview) -> None:
        started = time.perf_counter()
        while view.nbytes:
            try:
                count = os.write(self._fd, view)
            except OSError as error:
                raise OSError(error.errno, error.strerror, str(self.path)) from None
            view = view[count:]
            self._written += count
        self.write_seconds += time.perf_counter() - started
        if self._write_behind and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            os.posix_fadvise(self._fd, self._flushed, self._written - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._written

    def patch(self, offset: int, data: bytes) -> None:
        """Overwrite bytes already written (the crc32 digits of a rank file's header)."""
        if offset + len(data) <= self._written:
            if os.pwrite(self._fd, data, offset) != len(data):
                raise OSError(f"{self.path}: short write while patching the header")
        elif offset >= self._written:  # still in the buffer (a small file)
            self._buffer[offset - self._written: offset - self._written + len(data)] = data
        else:
            self._flush()
            self.patch(offset, data)

    def close(self) -> int:
        if self._fd < 0:
            return self.size
        try:
            self._flush()
            if self._written != self.size:
                raise ValueError(f"{self.path}: wrote {self._written} bytes, the header announced {self.size}")
            if self.sync:
                started = time.perf_counter()
                os.fsync(self._fd)
                self.fsync_seconds += time.perf_counter() - started
        finally:
            fd, self._fd = self._fd, -1
            os.close(fd)
        return self.size

    def abort(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)
        self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class StreamingWriter(_FileWriter):
    """Write one safetensors file whose header is known up front; data arrives in pieces.

    Usage::

        with StreamingWriter(path, entries, metadata={"format": "pt"}) as w:
            for name, info in w.order:        # the order data must be written in
                w.write(piece)                # any number of pieces per tensor, in order
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]], *,
                 metadata: dict[str, str] | None = None, write_behind: bool = False, sync: bool = True):
        header, self.order = layout_header(entries, metadata)
        self._open(path, header, len(header) + sum(info.nbytes for _, info in self.order), write_behind=write_behind, sync=sync)


class RankFileWriter(_FileWriter):
    """Write one v2 rank file laid out by `layout`: each fragment's bytes in data order, then
    `end_fragment(crc32)`."""

    def __init__(self, path: str | Path, layout: FileLayout, *, write_behind: bool = False, sync: bool = True):
        self.layout = layout
        self._crcs: list[int] = []
        self._open(path, layout.header, layout.size, write_behind=write_behind, sync=sync)

    def end_fragment(self, crc32: int) -> None:
        index = len(self._crcs)
        if index >= len(self.layout.fragments):
            raise ValueError(f"{self.path}: more fragments than the {len(self.layout.fragments)} its layout holds")
        end = self.layout.data_start + self.layout.spans[index][1]
        if self._written + self._buffered != end:
            raise ValueError(f"{self.path}: fragment {index} ends at byte {self._written + self._buffered}, its layout at {end}")
        self._crcs.append(crc32)

    def close(self) -> int:
        if self._fd >= 0 and len(self._crcs) != len(self.layout.fragments):
            self.abort()
            raise ValueError(f"{self.path}: {len(self._crcs)} of {len(self.layout.fragments)} fragments written")
        if self._fd >= 0 and self._crcs:
            self.patch(self.layout.crc_offset, "".join(f"{crc:08x}" for crc in self._crcs).encode("ascii"))
        return super().close()


@dataclass(frozen=True)
class WrittenCheckpoint:
    manifest: Manifest
    files: list[str]
    bytes: int


def write_sharded(directory: Path, *, sources: list[SourceTensor], placement: Placement, world_size: int, strategy: str,
                  training_state: dict, aliases: dict[str, str], cast_to: str | None, chunk_size: int,
                  progress: Callable[[int], None] | None = None, workers: int | None = None) -> WrittenCheckpoint:
    """A whole sharded checkpoint (v2) in `directory`: every rank file of `placement` at
    `world_size`, copied from `sources` (source checksums verified on the way, output crc32s
    from the bytes written), then manifest.json; `storage.staged_output` syncs them all at once.
    Every rank gets a file, possibly with no tensors.

    With many files, `workers` processes (default: one per CPU, at most 8, from 256 files on)
    each write a contiguous block of ranks: the per-file and per-fragment work runs in
    parallel. Each reads only part of most source fragments; their partial checksums are
    combined here (`check_partial_crcs`), so every source byte is still verified once."""
    tensors = tuple(TensorSpec(s.name, output_dtype(s.dtype, cast_to), tuple(s.shape)) for s in sources)
    manifest = Manifest(world_size, strategy, placement, tensors, dict(aliases), dict(training_state))
    workers = worker_count(world_size, workers)
    if workers == 1:
        parts, total = write_ranks(directory, sources, manifest, 0, world_size, chunk_size, progress=progress)
    else:
        jobs = [(directory, sources, manifest, world_size * i // workers, world_size * (i + 1) // workers, chunk_size)
                for i in range(workers)]
        outcomes = in_processes(write_ranks, jobs, progress)
        parts, total = [part for parts, _ in outcomes for part in parts], sum(total for _, total in outcomes)
    check_partial_crcs(parts)
    save_manifest(directory, manifest)
    return WrittenCheckpoint(manifest, [rank_file_name(rank, world_size) for rank in range(world_size)], total)


def write_ranks(directory: Path, sources: list[SourceTensor], manifest: Manifest, first: int, last: int, chunk_size: int,
                *, progress: Callable[[int], None] | None = None) -> tuple[list[PartialCrc], int]:
    """Rank files `first` to `last - 1` of `manifest`; returns the checksums of the source
    fragments read only in part, and the bytes written."""
    copier = ByteCopier(chunk_size=chunk_size, progress=progress, partial=True)
    layout, total = manifest.layout(), 0
    try:
        for rank in range(first, last):
            file_layout = layout.file_layout(rank)
            with RankFileWriter(directory / rank_file_name(rank, manifest.world_size), file_layout, write_behind=True,
                                sync=False) as writer:
                for tensor, start, end in file_layout.fragments:
                    writer.end_fragment(copier.copy(sources[tensor], ElementRange(start, end), manifest.tensors[tensor].dtype,
                                                    writer.write, checksum=True))
            total += file_layout.size
    finally:
        copier.close()
    return copier.finish(), total


def in_processes(function: Callable, jobs: list[tuple], progress: Callable[[int], None] | None) -> list:
    """`function(*job, progress=...)` for each job, each in its own process (spawned: no
    threads or locks inherited; `function` must be importable), results in order; a job's
    exception is raised here. The byte counts all of them report go to `progress`."""
    context = multiprocessing.get_context("spawn")
    done = context.Value("q", 0)
    with context.Pool(len(jobs), initializer=_start_worker, initargs=(done,)) as pool:
        results = [pool.apply_async(_call, (function, job)) for job in jobs]
        reported = 0
        while not all(result.ready() for result in results):
            time.sleep(0.05)
            if progress is not None and done.value > reported:
                progress(done.value - reported)
                reported = done.value
        outcomes = [result.get() for result in results]
        if progress is not None and done.value > reported:
            progress(done.value - reported)
    return outcomes


def worker_count(files: int, workers: int | None) -> int:
    """How many processes share `files` files: `workers`, or one per CPU (at most MAX_WORKERS)
    from WORKERS_FROM_FILES files on."""
    if workers is None:
        workers = min(os.cpu_count() or 1, MAX_WORKERS) if files >= WORKERS_FROM_FILES else 1
    return max(1, min(workers, files))


_done = None  # in a worker process: the shared count of bytes done


def _start_worker(done) -> None:
    global _done
    _done = done


def _advance(nbytes: int) -> None:
    with _done.get_lock():
        _done.value += nbytes


def _call(function: Callable, job: tuple):
    return function(*job, progress=_advance)
