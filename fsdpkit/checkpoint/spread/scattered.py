"""Bytes [begin, end) of an output file filled in one pass over source objects in a bucket, for
sources that hold the output's bytes in another order than the file's (a full output's tensors
in name order, from ZeRO-3 partitions in module order), where reading in the output's order
would fetch each object in many ranged GETs.

Each source object is read once, front to back: the runs of it that the output wants (runs
closer than GAP_BYTES joined), one streamed GET per run, FILES_IN_FLIGHT objects at once, each
source piece's bytes written (cast where asked) where the output wants them, into a local spool
file. The caller's thread sends the spool's bytes into the sink in order, each TILE_BYTES as soon
as all of its bytes are there. Memory holds a few blocks of each stream and one tile; local disk
holds the part while it is filled, so the spool is used only where TMPDIR is on a disk (not
tmpfs) with room for it, reserved before it is filled (`reserved_spool`). Each piece with a
checksum is checked when its last byte has passed."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourceTensor, merged_runs
from ..core.crc import cast_into, crc32, mismatch
from ..core.files import read_exactly, write_views
from ..storage.stored_path import StoredPath

TILE_BYTES = 8 << 20  # output bytes sent to the sink as one, once all are there
FILES_IN_FLIGHT = 4  # source objects streamed at once
STREAM_BLOCK_BYTES = 1 << 20
GAP_BYTES = 1 << 20  # wanted runs of one object this close are fetched by one GET, the gap dropped
SPOOL_MARGIN_BYTES = 256 << 20  # room TMPDIR keeps beside the spool
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
SPOOL = Path("spool")  # in messages: the spool file has no name


class Segment(NamedTuple):
    """A source piece and where its elements go."""

    source: StoredPath
    start: int  # bytes [start, end) of the source object
    end: int
    out_at: int  # where its first element goes, from the part's first byte
    cast: tuple[str, str] | None  # (source dtype, output dtype) where they differ
    crc32: int | None
    label: str

    @property
    def out_bytes(self) -> int:
        if self.cast is None:
            return self.end - self.start
        return (self.end - self.start) // dtype_info(self.cast[0]).itemsize * dtype_info(self.cast[1]).itemsize


class Wanted(NamedTuple):
    tensor: SourceTensor
    elements: ElementRange
    dtype: str  # the output's
    at: int  # the byte of the output file where element `elements.start` goes


def segments_of(wanted: Sequence[Wanted], begin: int) -> list[Segment] | None:
    """Where each source piece of `wanted` goes in a part that starts at byte `begin` of its file;
    None unless every piece is an object's and is wanted whole (its checksum checked in one pass)."""
    found: list[Segment] = []
    for tensor, elements, dtype, at in wanted:
        out_size = dtype_info(dtype).itemsize
        for piece in tensor.pieces_in(elements):
            if not isinstance(piece.path, StoredPath) or not (elements.start <= piece.range.start and piece.range.end <= elements.end):
                return None
            if piece.nbytes:
                out_at = at - begin + (piece.range.start - elements.start) * out_size
                cast = None if dtype == tensor.dtype else (tensor.dtype, dtype)
                found.append(Segment(piece.path, piece.offset, piece.offset + piece.nbytes, out_at, cast, piece.crc32, piece.label))
    return found


def reserved_spool(nbytes: int) -> BinaryIO | None:
    """A temporary file in TMPDIR with `nbytes` of its disk reserved (posix_fallocate: the ranks
    of one node reserve theirs each, so none runs out of room midway), where TMPDIR is on a disk
    (not a filesystem in memory, whose spool would be memory the bound does not count) with room
    for it and SPOOL_MARGIN_BYTES beside; None where not."""
    directory = tempfile.gettempdir()
    try:
        mounts = Path("/proc/self/mounts").read_text()
    except OSError:
        mounts = ""
    if filesystem_of(os.path.realpath(directory), mounts) in MEMORY_FILESYSTEMS:
        return None
    if shutil.disk_usage(directory).free < nbytes + SPOOL_MARGIN_BYTES:
        return None
    spool = tempfile.TemporaryFile(prefix="fsdpkit-spool-")
    if hasattr(os, "posix_fallocate") and nbytes:
        try:
            os.posix_fallocate(spool.fileno(), 0, nbytes)
        except OSError:  # the room went to another process since it was looked at
            spool.close()
            return None
    return spool


def filesystem_of(directory: str, mounts: str) -> str:
    """The type of the filesystem holding `directory` (an absolute real path), from the lines of
    /proc/self/mounts; "" where none is listed. Mount points with spaces are written octal-escaped."""
    found, longest = "", -1
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = directory == point or directory.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= longest:
            found, longest = fields[2], len(point)
    return found


class _Tiles:
    """How many bytes of each tile of the part are in the spool, and the source bytes read."""

    def __init__(self, size: int):
        self.size = size
        self.filled = [0] * -(-size // TILE_BYTES)
        self.bytes_read = 0
        self.changed = threading.Condition()

    def need(self, tile: int) -> int:
        return min(TILE_BYTES, self.size - tile * TILE_BYTES)

    def add(self, at: int, nbytes: int, read: int) -> None:
        with self.changed:
            while nbytes:
                tile = at // TILE_BYTES
                count = min(nbytes, (tile + 1) * TILE_BYTES - at)
                self.filled[tile] += count
                at, nbytes = at + count, nbytes - count
            self.bytes_read += read
            self.changed.notify_all()


class _Filling:
    """A segment being filled: source bytes done, their crc32, the bytes of a split element."""

    __slots__ = ("segment", "done", "crc", "carry")

    def __init__(self, segment: Segment):
        self.segment, self.done, self.crc, self.carry = segment, 0, 0, b""


def fill_and_send(spool: int, segments: Sequence[Segment], head: bytes, size: int, write: Callable[[bytes], None], progress) -> int:
    """The part (`size` bytes: `head`, then the bytes `segments` place) into `write`, in order,
    filled in the file open at `spool` (a `reserved_spool`'s); the source bytes read. `progress`
    (or None) gets source bytes as they are read."""
    placed = len(head) + sum(segment.out_bytes for segment in segments)
    if placed != size:
        raise ValueError(f"the head and the segments place {placed} bytes of a part of {size}")
    tiles = _Tiles(size)
    by_source: dict[StoredPath, list[Segment]] = {}
    for segment in segments:
        by_source.setdefault(segment.source, []).append(segment)
    stop = threading.Event()
    write_views(spool, [head], SPOOL, 0)
    tiles.add(0, len(head), 0)
    with ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="fsdpkit-fill") as pool:
        fills = [pool.submit(_fill_from, sorted(found, key=attrgetter("start")), spool, tiles, stop) for found in by_source.values()]
        for future in fills:
            future.add_done_callback(lambda _: _notify(tiles))
        try:
            _send(spool, tiles, fills, write, progress)
        finally:
            stop.set()
    for future in fills:  # a failure after a thread's last bytes were placed
        future.result()
    return tiles.bytes_read


def _notify(tiles: _Tiles) -> None:
    with tiles.changed:
        tiles.changed.notify_all()


def _send(fd: int, tiles: _Tiles, fills: list[Future], write: Callable[[bytes], None], progress) -> None:
    reported = 0
    for tile in range(len(tiles.filled)):
        need = tiles.need(tile)
        with tiles.changed:
            while tiles.filled[tile] < need:
                failed = next((f for f in fills if f.done() and f.exception() is not None), None)
                if failed is not None:
                    failed.result()
                if all(f.done() for f in fills):
                    raise AssertionError(f"output bytes [{tile * TILE_BYTES}, {tile * TILE_BYTES + need}) not all filled")
                tiles.changed.wait(1.0)
            read = tiles.bytes_read
        if progress is not None and read > reported:
            progress(read - reported)
            reported = read
        write(read_exactly(fd, need, tile * TILE_BYTES, SPOOL))
    if progress is not None and tiles.bytes_read > reported:
        progress(tiles.bytes_read - reported)


def _fill_from(segments: list[Segment], fd: int, tiles: _Tiles, stop: threading.Event) -> None:
    """The segments of one source object (sorted by start) filled from its runs, streamed in
    order; a failure stops every other object's (those yet to start read nothing)."""
    if stop.is_set():
        return
    try:
        _stream_into(segments, fd, tiles, stop)
    except BaseException:
        stop.set()
        raise


def _stream_into(segments: list[Segment], fd: int, tiles: _Tiles, stop: threading.Event) -> None:
    source = segments[0].source
    size = source.stat().st_size
    last = max(segments, key=attrgetter("end"))
    if last.end > size:
        raise DataCheckError(f"{source}: file ends before {last.label} does (truncated)")
    active: list[_Filling] = []
    following = 0
    blocks = source.storage.read_blocks(
        source.key, merged_runs([(segment.start, segment.end) for segment in segments], GAP_BYTES), block_bytes=STREAM_BLOCK_BYTES
    )
    with contextlib.closing(blocks):
        for offset, block in blocks:
            if stop.is_set():
                return
            end = offset + len(block)
            while following < len(segments) and segments[following].start < end:
                active.append(_Filling(segments[following]))
                following += 1
            for filling in active:
                lo, hi = max(filling.segment.start, offset), min(filling.segment.end, end)
                if lo < hi:
                    _put(filling, block[lo - offset : hi - offset], fd, tiles)
            active = [filling for filling in active if filling.segment.end > end]


def _put(filling: _Filling, data: memoryview, fd: int, tiles: _Tiles) -> None:
    """Source bytes `data` of a segment, next after those done, into the spool (cast where asked)."""
    segment = filling.segment
    if segment.crc32 is not None:
        filling.crc = crc32(data, filling.crc)
    if segment.cast is None:
        at, out = segment.out_at + filling.done, data
    else:
        in_size, out_size = dtype_info(segment.cast[0]).itemsize, dtype_info(segment.cast[1]).itemsize
        joined = memoryview(filling.carry + bytes(data)) if filling.carry else data
        whole = len(joined) // in_size * in_size
        at = segment.out_at + (filling.done - len(filling.carry)) // in_size * out_size
        out = cast_into(joined[:whole], *segment.cast, bytearray(whole // in_size * out_size))
        filling.carry = bytes(joined[whole:])
    filling.done += len(data)
    if filling.done == segment.end - segment.start and segment.crc32 is not None and filling.crc != segment.crc32:
        raise DataCheckError(f"{segment.source}: {mismatch(segment.label, segment.crc32, filling.crc)}")
    write_views(fd, [out], SPOOL, at)
    tiles.add(at, len(out), len(data))
