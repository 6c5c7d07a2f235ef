"""The one byte engine (no torch): every command that moves checkpoint bytes goes through a
`ByteEngine`: rank files (`write_rank_file`), streams into a writer (`copy`), element ranges
into memory (`read_into`). How it moves and checks bytes is docs/checkpoint-format.md's "How
convert and reshard copy"; mappings are windows of two `WINDOW_BYTES` blocks in a bounded LRU.

A `SourceTensor` says where each element range of a tensor lies (`SourcePiece`s). A source
piece's running crc32 is checked when its last byte has passed (a `DataCheckError`), so the
fragments of each tensor must be asked for in increasing order, as the placements guarantee;
`finish()` checks that every piece started was read to its end, and `finish_parts()` returns
the pieces an engine writing a share of the rank files (`workers`) read only in part, for
`check_parts`. Sources are checkpoints at rest (a file truncated while mapped would raise SIGBUS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple, Protocol

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from .crc import PartRead, StorageSpan, cast_into, check_parts, crc32, crc32_combine, mismatch
from .files import IOV_MAX, WINDOW_BYTES, Descriptor, MappedFiles, WriteQueue, pread_into, write_file, write_views
from .names import numel

DEFAULT_CHUNK_SIZE = 512 * 1024  # bytes per block: read, checksummed and handed on while in the L2 cache
KERNEL_COPY_BYTES = 256 << 10  # fragments at least this large are copied by the kernel
WHOLE_FILE_BYTES = 8 * 1024 * 1024  # a rank file up to this size is one writev; larger ones are written in such steps
PROGRESS_BYTES = 8 * 1024 * 1024  # progress is reported in steps of this
READ_AHEAD_BYTES = 64 << 20  # source bytes of a batch `read_ahead` fetches in file order
RUN_GAP_BYTES = 4 << 10  # runs of one file this close are fetched as one, the gap too (a ZeRO-3 partition's padding)


class SourcePiece(NamedTuple):
    range: ElementRange  # elements of the tensor this piece holds
    path: Path
    offset: int  # absolute byte offset in `path` of element range.start
    nbytes: int  # bytes of the whole piece
    crc32: int | None  # of the whole piece's bytes; None when the source has no checksum
    key: str  # the tensor it belongs to (for messages)
    storage: StorageSpan | None = None  # the zip record holding it with other tensors' pieces, checked whole (`check_parts`)

    @property
    def label(self) -> str:
        return f"{self.path.name} tensor {self.key!r} [{self.range.start}, {self.range.end})"

    @property
    def checked(self) -> bool:
        """Whether its bytes are checked as they pass: against its own crc32, or its storage's."""
        return self.crc32 is not None or self.storage is not None


@dataclass(frozen=True)
class SourceTensor:
    """A tensor and where its elements lie. `pieces_in(wanted)` gives, in order, the pieces that
    meet a range; subclasses compute them on demand (sharded checkpoints)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[SourcePiece, ...] = ()

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype).itemsize

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        return [p for p in self.pieces if p.range.start < wanted.end and wanted.start < p.range.end]


def _source_bytes(wanted: tuple[SourceTensor, ElementRange]) -> int:
    return wanted[1].size * dtype_info(wanted[0].dtype).itemsize


def merged_runs(spans: list[tuple[int, int]], gap: int = RUN_GAP_BYTES) -> list[tuple[int, int]]:
    """Byte spans [start, end) sorted and merged into runs where they meet, overlap or are at
    most `gap` bytes apart (by default a ZeRO-3 partition's padding)."""
    runs: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if runs and start <= runs[-1][1] + gap:
            runs[-1] = (runs[-1][0], max(runs[-1][1], end))
        else:
            runs.append((start, end))
    return runs


class _Piece:
    """A source piece being read, and how far: bytes [begin, done) from its start, `running` their crc32."""

    __slots__ = ("source", "first", "last", "file", "offset", "nbytes", "begin", "done", "running", "window", "window_start", "window_end")

    def __init__(self, source: SourcePiece, file: int, begin: int):
        self.source = source
        self.first, self.last = source.range.start, source.range.end  # elements of the tensor
        self.file, self.offset, self.nbytes = file, source.offset, source.nbytes  # absolute byte offset in the file
        self.begin = self.done = begin
        self.running = 0
        self.window: memoryview | None = None  # the mapping last used, and the file offsets it covers
        self.window_start = self.window_end = 0


class _Cursor:
    """Where reading one source tensor (cast to one output dtype) has got to."""

    __slots__ = ("source", "itemsize", "cast", "pieces", "current")

    def __init__(self, source: SourceTensor, out_dtype: str):
        self.source = source
        self.itemsize = dtype_info(source.dtype).itemsize
        self.cast = None if out_dtype == source.dtype else (source.dtype, out_dtype)
        self.pieces: dict[int, _Piece] = {}  # by first element: pieces started and not finished
        self.current: _Piece | None = None  # the piece the last read ended in


class RankFileLayout(Protocol):
    """What `write_rank_file` needs of one rank file's layout (fsdpkit's `placement.FileLayout`):
    its fragments in data order, each one's byte span in the data buffer, the header and the size."""

    @property
    def rank(self) -> int: ...
    @property
    def tensors(self) -> tuple[int, ...]: ...
    @property
    def starts(self) -> tuple[int, ...]: ...
    @property
    def ends(self) -> tuple[int, ...]: ...
    @property
    def spans(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def size(self) -> int: ...
    @property
    def data_start(self) -> int: ...

    def header_with(self, crcs) -> list[bytes]: ...


def _cast(cursor: _Cursor, view: memoryview) -> memoryview:
    """A block of the cursor's source bytes cast to its output dtype."""
    assert cursor.cast is not None
    return cast_into(view, *cursor.cast, bytearray(view.nbytes // cursor.itemsize * dtype_info(cursor.cast[1]).itemsize))


class ByteEngine:
    """See the module docstring. `sources` (with their output dtypes) are the tensors that
    `fragments` and `write_rank_file` address by index; `copy` and `read_into` take any tensor.
    `chunk_size` bounds each block (at most WINDOW_BYTES); `progress` gets source bytes done."""

    def __init__(
        self,
        sources: Sequence[SourceTensor] = (),
        out_dtypes: Sequence[str] = (),
        *,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        progress: Callable[[int], None] | None = None,
    ):
        if chunk_size < 64:
            raise ValueError(f"chunk size must be at least 64 bytes, got {chunk_size}")
        self.block = min(chunk_size, WINDOW_BYTES) // 8 * 8  # whole elements of any dtype
        self._cursors = [_Cursor(source, dtype) for source, dtype in zip(sources, out_dtypes, strict=True)]
        self._named: dict[tuple[str, str], _Cursor] = {}  # cursors of tensors given to copy()
        self._verified: set[tuple[int, int]] = set()  # (file, offset) of pieces read_into checked whole
        self._files = MappedFiles()
        self._parts: list[PartRead] = []  # pieces finished here that were started elsewhere
        self._writes: WriteQueue | None = None  # made by the first write_rank_file
        self._progress, self._reported = progress, 0
        self.bytes_read = 0  # source bytes handed on so far

    def write_rank_file(self, path: Path, layout: RankFileLayout) -> list[int]:
        """Rank file `layout` at `path`: a small one is one `writev` of its header and mapped
        slices, here; a larger one is queued to the write threads in steps, its header with the
        crc32 digits last, and fsynced there (the disk writes it while the next is copied). The
        caller syncs and, on an error, removes the whole output once `close` has returned.
        Returns the crc32 of each fragment written."""
        if layout.size <= WHOLE_FILE_BYTES:
            views: list = []
            crcs = self.fragments(layout.tensors, layout.starts, layout.ends, views)
            write_file(path, layout.header_with(crcs) + views)
        else:
            if self._writes is None:
                self._writes = WriteQueue()
            fd = self._writes.open(path)
            crcs = self._stream_rank_file(fd, path, layout, self._writes)
            self._writes.seal(layout.rank, fd)
        self._report()
        return crcs

    def _stream_rank_file(self, fd: int, path: Path, layout: RankFileLayout, writes: WriteQueue) -> list[int]:
        views: list = []
        crcs, pending, at, lane = [], 0, layout.data_start, layout.rank  # pending: bytes of `views`, to be written at `at`
        for t, start, end, (begin, stop) in zip(layout.tensors, layout.starts, layout.ends, layout.spans, strict=True):
            if stop - begin >= KERNEL_COPY_BYTES and self._cursors[t].cast is None:
                if views:
                    writes.submit(lane, pending, write_views, fd, views, path, at)
                views, pending, at = [], 0, layout.data_start + stop
                crcs.append(self._send(self._cursors[t], start, end, (lane, fd, path), layout.data_start + begin))
                continue
            step = max(1, WHOLE_FILE_BYTES * (end - start) // (stop - begin))  # elements per step
            crc = 0
            for first in range(start, end, step):
                last = min(first + step, end)
                part = self.fragments((t,), (first,), (last,), views)[0]
                size = (stop - begin) * (last - first) // (end - start)
                crc = crc32_combine(crc, part, size) if first > start else part
                pending += size
                if pending >= WHOLE_FILE_BYTES or len(views) >= IOV_MAX:
                    writes.submit(lane, pending, write_views, fd, views, path, at)
                    views, pending, at = [], 0, at + pending
            crcs.append(crc)
        if views:
            writes.submit(lane, pending, write_views, fd, views, path, at)
        writes.submit(lane, layout.data_start, write_views, fd, layout.header_with(crcs), path, 0)
        return crcs

    def fragments(self, tensors, starts, ends, views: list) -> list[int]:
        """Append the bytes of elements [start, end) of source `tensor` to `views`, for each (tensor,
        start, end) in turn; their crc32s. A fragment inside the window its piece last used takes
        the inlined path (a large world size has millions)."""
        crcs = []
        cursors, block = self._cursors, self.block
        done = 0
        for tensor, start, end in zip(tensors, starts, ends, strict=True):
            cursor = cursors[tensor]
            piece = cursor.current
            if piece is not None and piece.first <= start and end <= piece.last and cursor.cast is None:
                itemsize = cursor.itemsize
                at = (start - piece.first) * itemsize
                nbytes = (end - start) * itemsize
                offset = piece.offset + at
                if at == piece.done and nbytes <= block and piece.window_start <= offset and offset + nbytes <= piece.window_end:
                    offset -= piece.window_start
                    view = piece.window[offset : offset + nbytes]  # type: ignore[index]
                    crc = crc32(view)
                    views.append(view)
                    crcs.append(crc)
                    done += nbytes
                    piece.running = crc32_combine(piece.running, crc, nbytes) if at else crc
                    piece.done = at + nbytes
                    if piece.done == piece.nbytes:
                        self._finish_piece(cursor, piece)
                    continue
            out_crc = 0  # the general case: several pieces or blocks, a new window, a cast
            for view, crc in self._cast_blocks(cursor, start, end):
                views.append(view)
                out_crc = crc32_combine(out_crc, crc, len(view))
            crcs.append(out_crc)
        self.bytes_read += done
        return crcs

    def _cast_blocks(self, cursor: _Cursor, start: int, end: int) -> Iterator[tuple[memoryview, int]]:
        for _, view, crc in self._blocks(cursor, start, end):
            if cursor.cast is not None:
                view = _cast(cursor, view)
                crc = crc32(view)
            yield view, crc

    def _blocks(self, cursor: _Cursor, start: int, end: int) -> Iterator[tuple[_Piece, memoryview, int]]:
        """(piece, mapped source bytes, their crc32) of elements [start, end), at most one block
        each, in order; every source piece's running crc32 advanced and checked at its end."""
        itemsize = cursor.itemsize
        position = start
        while position < end:
            piece = self._piece_at(cursor, position, end)
            stop = min(end, piece.last)
            at = (position - piece.first) * itemsize
            if at != piece.done:
                raise AssertionError(f"{piece.source.label}: read at byte {at}, expected {piece.done} (fragments must be read in order)")
            remaining = (stop - position) * itemsize
            until = piece.offset + (stop - piece.first) * itemsize  # where this read of the piece ends
            while remaining:
                nbytes = min(remaining, self.block)
                view = self._view(piece, piece.offset + piece.done, nbytes, until)
                crc = crc32(view)
                piece.running = crc32_combine(piece.running, crc, nbytes) if piece.done else crc
                piece.done += nbytes
                self.bytes_read += nbytes
                remaining -= nbytes
                yield piece, view, crc
            cursor.current = piece
            if piece.done == piece.nbytes:
                self._finish_piece(cursor, piece)
            position = stop

    def _send(self, cursor: _Cursor, start: int, end: int, out: tuple[int, int, Path], at: int) -> int:
        """Elements [start, end) copied by the kernel to byte `at` of output `out` (lane, fd,
        path), one copy per source piece, checksummed on the way through the mapping; their crc32."""
        assert self._writes is not None
        lane, fd, path = out
        out_crc = 0
        for piece, blocks in groupby(self._blocks(cursor, start, end), key=itemgetter(0)):
            source = self._files.fd(piece.file)
            count, views, pending = 0, [], 0  # an object's bytes (no kernel copy) are written from their views
            for _, view, crc in blocks:
                out_crc = crc32_combine(out_crc, crc, view.nbytes)
                count += view.nbytes
                if not isinstance(source, int):
                    views.append(view)
                    pending += view.nbytes
                    if pending >= WHOLE_FILE_BYTES:
                        self._writes.submit(lane, pending, write_views, fd, views, path, at + count - pending)
                        views, pending = [], 0
            if isinstance(source, int):
                self._writes.copy(lane, source, piece.offset + piece.done - count, count, fd, at, path)
            elif views:
                self._writes.submit(lane, pending, write_views, fd, views, path, at + count - pending)
            at += count
        return out_crc

    def copy(self, tensor: SourceTensor, wanted: ElementRange, out_dtype: str, sink: Callable[[memoryview], None]) -> None:
        """Stream elements `wanted` of `tensor`, cast to `out_dtype`, into `sink`."""
        cursor = self._named.get((tensor.name, out_dtype))
        if cursor is None or cursor.source is not tensor:
            cursor = self._named[(tensor.name, out_dtype)] = _Cursor(tensor, out_dtype)
        for _, view, _ in self._blocks(cursor, wanted.start, wanted.end):  # the sink checksums what it writes
            sink(view if cursor.cast is None else _cast(cursor, view))
            self._report()

    def copy_or_send(
        self,
        tensor: SourceTensor,
        wanted: ElementRange,
        out_dtype: str,
        sink: Callable[[memoryview], None],
        send: Callable[[Descriptor, int, int], None],
    ) -> None:
        """As `copy`, except that each source piece with no checksum (nothing to check on the way,
        neither its own nor its storage's) holding at least KERNEL_COPY_BYTES of `wanted`, uncast, is never mapped: `send(fd, offset,
        count)` has the kernel copy its bytes (an object in a bucket streams them through the face)."""
        if out_dtype != tensor.dtype:
            self.copy(tensor, wanted, out_dtype, sink)
            return
        itemsize, position = dtype_info(tensor.dtype).itemsize, wanted.start
        for piece in tensor.pieces_in(wanted):
            part = piece.range.intersect(wanted)
            if piece.checked or part.size * itemsize < KERNEL_COPY_BYTES:
                continue
            if part.start > position:
                self.copy(tensor, ElementRange(position, part.start), out_dtype, sink)
            number = self._file_of(piece)
            send(self._files.fd(number), piece.offset + (part.start - piece.range.start) * itemsize, part.size * itemsize)
            self.bytes_read += part.size * itemsize
            self._report()
            position = part.end
        if position < wanted.end:
            self.copy(tensor, ElementRange(position, wanted.end), out_dtype, sink)

    def read_ahead(self, wanted: Sequence[tuple[SourceTensor, ElementRange]]) -> Iterator[int]:
        """The indices of `wanted` (tensors and element ranges, in the order they will be read),
        a batch of consecutive ones of at most READ_AHEAD_BYTES of the source at a time: before a
        batch's are handed on, its bytes held in objects (a bucket's) are fetched in file-offset
        order, as runs (`merged_runs`), and held until the next batch, so a reader that wants
        them in another order than the files' (the full output's) takes a few GETs per file, not
        one per tensor. One larger than READ_AHEAD_BYTES is a batch of its own, read as it comes.
        Local files are mapped as they are read, in any order: all of `wanted` is one batch."""
        if not self._in_objects(wanted):
            yield from range(len(wanted))
            return
        start = 0
        while start < len(wanted):
            end, total = start + 1, _source_bytes(wanted[start])
            while end < len(wanted) and total + _source_bytes(wanted[end]) <= READ_AHEAD_BYTES:
                total += _source_bytes(wanted[end])
                end += 1
            self._files.read_ahead(self._runs(wanted[start:end]) if total <= READ_AHEAD_BYTES else {})
            yield from range(start, end)
            start = end
        self._files.read_ahead({})

    def _in_objects(self, wanted: Sequence[tuple[SourceTensor, ElementRange]]) -> bool:
        """Whether the source's files are objects of a storage, as its first piece's file is (a
        checkpoint's files are all local, or all in one storage)."""
        for tensor, elements in wanted:
            for piece in tensor.pieces_in(elements)[:1]:
                return not isinstance(self._files.fd(self._file_of(piece)), int)
        return False

    def _runs(self, wanted: Sequence[tuple[SourceTensor, ElementRange]]) -> dict[int, list[tuple[int, int]]]:
        """The byte runs of the source files (by number) that hold elements `wanted`."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for tensor, elements in wanted:
            itemsize = dtype_info(tensor.dtype).itemsize
            for piece in tensor.pieces_in(elements):
                part = piece.range.intersect(elements)
                start = piece.offset + (part.start - piece.range.start) * itemsize
                spans.setdefault(self._file_of(piece), []).append((start, start + part.size * itemsize))
        return {number: merged_runs(found) for number, found in spans.items()}

    def checked_blocks(self, tensor: SourceTensor, wanted: ElementRange, out_dtype: str, block_bytes: int) -> Iterator[memoryview]:
        """Elements `wanted` of `tensor`, cast to `out_dtype`, in blocks of at most `block_bytes`
        of the source, each read by `read_into` (random access, checksums checked)."""
        itemsize = dtype_info(tensor.dtype).itemsize
        step = max(1, block_bytes // itemsize)
        for first in range(wanted.start, wanted.end, step):
            block = ElementRange(first, min(first + step, wanted.end))
            data = memoryview(bytearray(block.size * itemsize))
            self.read_into(tensor, block, data)
            if out_dtype != tensor.dtype:
                data = cast_into(data, tensor.dtype, out_dtype, bytearray(block.size * dtype_info(out_dtype).itemsize))
            yield data

    def read_into(self, tensor: SourceTensor, wanted: ElementRange, out: memoryview) -> None:
        """Random access (loading): the bytes of elements `wanted` of `tensor` into `out`. A piece
        with a checksum is read whole, and its crc32 checked, the first time any part of it is
        wanted (one in a storage, its crc32 kept for the storage's check: `finish_parts`); later
        reads of it take only the bytes wanted."""
        itemsize = dtype_info(tensor.dtype).itemsize
        if out.nbytes != wanted.size * itemsize:
            raise ValueError(f"{tensor.name}: {out.nbytes} bytes of room for {wanted.size} elements of {tensor.dtype}")
        base = wanted.start * itemsize
        for piece in tensor.pieces_in(wanted):
            part = piece.range.intersect(wanted)
            file = self._file_of(piece)
            if not piece.checked or (file, piece.offset) in self._verified:
                start = piece.offset + (part.start - piece.range.start) * itemsize
                pread_into(self._files.fd(file), start, out[part.start * itemsize - base : part.end * itemsize - base], piece.path)
                continue
            reading, first, crc = _Piece(piece, file, 0), piece.range.start * itemsize, 0
            for at in range(0, piece.nbytes, self.block):  # windows read past are released: a load's mapped pages stay bounded
                view = self._view(reading, piece.offset + at, min(self.block, piece.nbytes - at), piece.offset + piece.nbytes)
                crc = crc32(view, crc)
                lo, hi = max(first + at, part.start * itemsize), min(first + at + view.nbytes, part.end * itemsize)
                if lo < hi:
                    out[lo - base : hi - base] = view[lo - first - at : hi - first - at]
                del view
            if reading.window is not None:
                self._files.release(file, reading.window_start, reading.window)
            if piece.crc32 is not None and crc != piece.crc32:
                raise DataCheckError(f"{piece.path}: {mismatch(piece.label, piece.crc32, crc)}")
            if piece.storage is not None:
                reading.done, reading.running = piece.nbytes, crc
                self._parts.append(self._storage_part(reading))
            self._verified.add((file, piece.offset))

    def _file_of(self, piece: SourcePiece) -> int:
        """The number of the file holding `piece`, checked to be long enough."""
        number = self._files.number(piece.path)
        if piece.offset + piece.nbytes > self._files.sizes[number]:
            raise DataCheckError(f"{piece.path}: file ends before {piece.label} does (truncated)")
        return number

    def _piece_at(self, cursor: _Cursor, position: int, end: int) -> _Piece:
        """The piece of the cursor's tensor that holds element `position` (reads move forward, so
        it is the current piece, or one that starts there)."""
        piece = cursor.current
        if piece is not None and piece.first <= position < piece.last:
            return piece
        piece = cursor.pieces.get(position)
        if piece is None:
            for found in cursor.source.pieces_in(ElementRange(position, end)):
                known = cursor.pieces.get(found.range.start)
                if known is None:
                    begin = max(position - found.range.start, 0) * cursor.itemsize  # a share may start mid-piece
                    known = cursor.pieces[found.range.start] = _Piece(found, self._file_of(found), begin)
                if known.first <= position < known.last:
                    piece = known
        if piece is None:
            raise AssertionError(f"{cursor.source.name}: no source piece holds element {position}")
        return piece

    def _view(self, piece: _Piece, offset: int, nbytes: int, until: int) -> memoryview:
        """Bytes [offset, offset + nbytes) of `piece`, read on to `until` (an object's GET ends there)."""
        window = piece.window
        if window is None or not (piece.window_start <= offset and offset + nbytes <= piece.window_end):
            if window is not None:  # reads move forward: the piece is done with its window
                self._files.release(piece.file, piece.window_start, window)
            piece.window_start, window = self._files.window(piece.file, offset, until)
            piece.window = window
            piece.window_end = piece.window_start + len(window)
        return window[offset - piece.window_start : offset - piece.window_start + nbytes]

    def _finish_piece(self, cursor: _Cursor, piece: _Piece) -> None:
        del cursor.pieces[piece.first]
        cursor.current = None
        if piece.window is not None and piece.offset + piece.nbytes >= piece.window_end:
            self._files.release(piece.file, piece.window_start, piece.window)  # nothing after the piece in it either
        piece.window = None
        if piece.source.storage is not None:
            self._parts.append(self._storage_part(piece))
        if piece.begin:
            self._parts.append(self._part(piece))
        elif piece.source.crc32 is not None and piece.running != piece.source.crc32:
            raise DataCheckError(f"{self._files.paths[piece.file]}: {mismatch(piece.source.label, piece.source.crc32, piece.running)}")

    def _report(self, at_least: int = PROGRESS_BYTES) -> None:
        if self._progress is not None and self.bytes_read - self._reported >= at_least:
            self._progress(self.bytes_read - self._reported)
            self._reported = self.bytes_read

    def finish(self) -> None:
        """Close the files; every source piece started must have been read whole."""
        check_parts(self.finish_parts())

    def finish_parts(self) -> list[PartRead]:
        """Close the files; the source pieces read only in part (see the module docstring)."""
        self.close()
        unfinished = [piece for cursor in [*self._cursors, *self._named.values()] for piece in cursor.pieces.values()]
        stored = [self._storage_part(piece) for piece in unfinished if piece.source.storage is not None]
        return self._parts + [self._part(piece) for piece in unfinished] + stored

    def _part(self, piece: _Piece) -> PartRead:
        path = self._files.paths[piece.file]
        return PartRead(path, piece.offset, piece.nbytes, piece.source.crc32, piece.source.label, piece.begin, piece.done, piece.running)

    def _storage_part(self, piece: _Piece) -> PartRead:
        """The bytes of its storage that `piece` read, and their crc32."""
        storage = piece.source.storage
        assert storage is not None
        at = piece.offset - storage.offset
        path = self._files.paths[piece.file]
        label = f"storage {storage.key!r}"
        return PartRead(path, storage.offset, storage.nbytes, storage.crc32, label, at + piece.begin, at + piece.done, piece.running, True)

    def close(self) -> None:
        """Wait for every queued write (raising the first that failed), close the files."""
        self._report(at_least=1)
        writes, self._writes = self._writes, None
        try:
            if writes is not None:
                writes.close()
        finally:
            self._files.close()
