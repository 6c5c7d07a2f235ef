"""Gathering output fragments from mapped source files (no torch): the byte path of
`write_sharded` (convert --to sharded, reshard), where a large world size means millions of
fragments of a few KB each.

`Gatherer(sources, out_dtypes, block_size=...)`: `fragment(tensor, start, end, views)`
appends to `views` the bytes of elements [start, end) of source tensor `tensor` (cast to its
output dtype) and returns their crc32. The bytes are slices of read-only mappings of the
source files (two adjacent `WINDOW_BYTES` blocks per mapping, a bounded LRU of them), so
nothing is copied in user space: the caller hands the slices to `os.writev`, and the kernel
copies them once, into the output file. A cast (floats, `--dtype`) produces new bytes instead.

Checksums, one pass over the data: every slice is checksummed once with `zlib.crc32`; that
value is the output fragment's crc32 (or is combined into it when the fragment was cut from
several source pieces or blocks) and is combined into the running crc32 of the source piece
it came from (`CrcShifter`, table-driven for the lengths a large world size repeats). When a
source piece's last byte has passed, its crc32 must equal the stored one, else a
`DataCheckError`: every source byte is verified once, on the bytes handed on. Each tensor's
fragments must be asked for in increasing order, and each source piece read front to back,
which the placements guarantee; `finish()` checks that every source piece started was read
to its end.

A source file is opened (a regular file, without blocking) and its size taken when first
used; a piece that would end beyond it is a `DataCheckError`. A file truncated by someone
else while it is mapped would raise SIGBUS: sources are checkpoints at rest.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections import OrderedDict
from pathlib import Path

from ..errors import DataCheckError
from ..layout import ElementRange
from .bytecopy import SourceTensor, cast_into, open_regular_file
from .crc import CrcShifter
from .format import dtype_info

WINDOW_BYTES = 512 << 10  # a mapping covers two such blocks, so any slice of at most one block fits in one mapping
MAX_WINDOWS = 96  # mappings kept (each piece drops the one it has read past): at most 2 * MAX_WINDOWS * WINDOW_BYTES of RSS
MAX_OPEN_FILES = 64


class _Piece:
    """A source piece (one fragment of a source tensor, or a whole tensor of a full file) and how
    far it has been read."""

    __slots__ = ("first", "last", "file", "offset", "nbytes", "crc32", "label", "done", "running", "window", "window_start", "window_end")

    def __init__(self, first: int, last: int, file: int, offset: int, nbytes: int, crc32: int | None, label: str):
        self.first, self.last = first, last  # elements of the tensor
        self.file, self.offset, self.nbytes = file, offset, nbytes  # absolute byte offset in the file
        self.crc32, self.label = crc32, label
        self.done = 0  # bytes read so far, from the piece's start
        self.running = 0  # crc32 of those bytes
        self.window: memoryview | None = None  # the mapping last used, and the file offsets it covers
        self.window_start = self.window_end = 0


class _Cursor:
    """Where reading one source tensor has got to."""

    __slots__ = ("source", "itemsize", "cast", "pieces", "current")

    def __init__(self, source: SourceTensor, out_dtype: str):
        self.source = source
        self.itemsize = dtype_info(source.dtype).itemsize
        self.cast = None if out_dtype == source.dtype else (source.dtype, out_dtype)
        self.pieces: dict[int, _Piece] = {}  # by first element: pieces started and not finished
        self.current: _Piece | None = None  # the piece the last read ended in


class _MappedFiles:
    """Source files by number, mapped in windows (an LRU of mappings shared by all pieces)."""

    def __init__(self) -> None:
        self._numbers: dict[Path, int] = {}
        self._paths: list[Path] = []
        self._sizes: list[int] = []
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int], memoryview] = OrderedDict()

    def number(self, path: Path) -> int:
        number = self._numbers.get(path)
        if number is None:
            fd = open_regular_file(path)
            number = self._numbers[path] = len(self._paths)
            self._paths.append(path)
            self._sizes.append(os.fstat(fd).st_size)
            self._fds[number] = fd
            self._trim_fds()
        return number

    def path(self, number: int) -> Path:
        return self._paths[number]

    def size(self, number: int) -> int:
        return self._sizes[number]

    def window(self, number: int, offset: int) -> tuple[int, memoryview]:
        """(file offset where it starts, the mapping) of a window holding at least bytes
        [offset, offset + WINDOW_BYTES) of file `number`, or up to its end."""
        block = offset // WINDOW_BYTES
        key = (number, block)
        view = self._windows.get(key)
        if view is None:
            start = block * WINDOW_BYTES
            length = min(2 * WINDOW_BYTES, self._sizes[number] - start)
            view = self._windows[key] = memoryview(mmap.mmap(self._fd(number), length, access=mmap.ACCESS_READ, offset=start))
            if len(self._windows) > MAX_WINDOWS:
                self._windows.popitem(last=False)  # unmapped when no slice of it is left
        else:
            self._windows.move_to_end(key)
        return block * WINDOW_BYTES, view

    def release(self, number: int, start: int, view: memoryview) -> None:
        """Forget the window at `start` (a piece has read past it), unless it has been replaced."""
        key = (number, start // WINDOW_BYTES)
        if self._windows.get(key) is view:
            del self._windows[key]

    def _fd(self, number: int) -> int:
        fd = self._fds.get(number)
        if fd is None:
            fd = self._fds[number] = open_regular_file(self._paths[number])
            self._trim_fds()
        else:
            self._fds.move_to_end(number)
        return fd

    def _trim_fds(self) -> None:
        while len(self._fds) > MAX_OPEN_FILES:
            os.close(self._fds.popitem(last=False)[1])

    def close(self) -> None:
        self._windows.clear()
        while self._fds:
            os.close(self._fds.popitem()[1])


class Gatherer:
    """See the module docstring. `block_size` bounds each slice (at most WINDOW_BYTES)."""

    def __init__(self, sources: list[SourceTensor], out_dtypes: list[str], *, block_size: int):
        if block_size < 64:
            raise ValueError(f"block size must be at least 64 bytes, got {block_size}")
        self.block = min(block_size, WINDOW_BYTES) // 8 * 8  # whole elements of any dtype
        self._cursors = [_Cursor(source, out_dtype) for source, out_dtype in zip(sources, out_dtypes, strict=True)]
        self._files = _MappedFiles()
        self._shifter = CrcShifter()
        self.bytes_read = 0  # source bytes handed on so far

    def fragment(self, tensor: int, start: int, end: int, views: list) -> int:
        """Append the bytes of elements [start, end) of tensor `tensor` to `views`; their crc32."""
        return self.fragments((tensor,), (start,), (end,), views)[0]

    def fragments(self, tensors, starts, ends, views: list) -> list[int]:
        """`fragment` for each (tensor, start, end) in turn; their crc32s."""
        crcs = []
        cursors, block, tables, crc32 = self._cursors, self.block, self._shifter.tables, zlib.crc32
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
                    view = piece.window[offset : offset + nbytes]
                    crc = crc32(view)
                    views.append(view)
                    crcs.append(crc)
                    done += nbytes
                    if at:
                        running, shift = piece.running, tables.get(nbytes)
                        if shift is None:
                            piece.running = self._shifter.shift(running, nbytes) ^ crc
                        else:
                            piece.running = (
                                shift[0][running & 255]
                                ^ shift[1][(running >> 8) & 255]
                                ^ shift[2][(running >> 16) & 255]
                                ^ shift[3][running >> 24]
                                ^ crc
                            )
                    else:
                        piece.running = crc
                    piece.done = at + nbytes
                    if piece.done == piece.nbytes:
                        self._finish_piece(cursor, piece)
                    continue
            crcs.append(self._fragment(cursor, start, end, views))
        self.bytes_read += done
        return crcs

    def _fragment(self, cursor: _Cursor, start: int, end: int, views: list) -> int:
        """The general case: several pieces, several blocks, a new window, a cast."""
        itemsize, shifter, out_crc, fresh = cursor.itemsize, self._shifter, 0, True
        position = start
        while position < end:
            piece = self._piece_at(cursor, position, end)
            stop = min(end, piece.last)
            if (position - piece.first) * itemsize != piece.done:
                raise AssertionError(
                    f"{piece.label}: read at byte {(position - piece.first) * itemsize}, "
                    f"expected {piece.done} (fragments must be read in order)"
                )
            remaining = (stop - position) * itemsize
            while remaining:
                nbytes = min(remaining, self.block)
                view = self._view(piece, piece.offset + piece.done, nbytes)
                crc = zlib.crc32(view)
                piece.running = shifter.shift(piece.running, nbytes) ^ crc if piece.done else crc
                piece.done += nbytes
                self.bytes_read += nbytes
                remaining -= nbytes
                if cursor.cast is not None:
                    view = cast_into(view, *cursor.cast, bytearray(nbytes // itemsize * dtype_info(cursor.cast[1]).itemsize))
                    crc = zlib.crc32(view)
                views.append(view)
                out_crc = crc if fresh else shifter.shift(out_crc, len(view)) ^ crc
                fresh = False
            cursor.current = piece
            if piece.done == piece.nbytes:
                self._finish_piece(cursor, piece)
            position = stop
        return out_crc

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
                    number = self._files.number(found.path)
                    if found.offset + found.nbytes > self._files.size(number):
                        raise DataCheckError(f"{found.path}: file ends before {found.label} does (truncated)")
                    known = cursor.pieces[found.range.start] = _Piece(
                        found.range.start, found.range.end, number, found.offset, found.nbytes, found.crc32, found.label
                    )
                if known.first <= position < known.last:
                    piece = known
        if piece is None:
            raise AssertionError(f"{cursor.source.name}: no source piece holds element {position}")
        return piece

    def _view(self, piece: _Piece, offset: int, nbytes: int) -> memoryview:
        window = piece.window
        if window is None or not (piece.window_start <= offset and offset + nbytes <= piece.window_end):
            if window is not None:  # reads move forward: the piece is done with its window
                self._files.release(piece.file, piece.window_start, window)
            piece.window_start, window = self._files.window(piece.file, offset)
            piece.window = window
            piece.window_end = piece.window_start + len(window)
        return window[offset - piece.window_start : offset - piece.window_start + nbytes]

    def _finish_piece(self, cursor: _Cursor, piece: _Piece) -> None:
        del cursor.pieces[piece.first]
        cursor.current = None
        if piece.window is not None and piece.offset + piece.nbytes >= piece.window_end:
            self._files.release(piece.file, piece.window_start, piece.window)  # nothing after the piece in it either
        piece.window = None
        if piece.crc32 is not None and piece.running != piece.crc32:
            raise DataCheckError(
                f"{self._files.path(piece.file)}: checksum mismatch in {piece.label}: stored crc32 "
                f"{piece.crc32:08x}, data gives {piece.running:08x} (corrupt file)"
            )

    def finish(self) -> None:
        """Close the files; every source piece started must have been read to its end."""
        self.close()
        for cursor in self._cursors:
            for piece in cursor.pieces.values():
                raise AssertionError(f"{piece.label}: read only up to byte {piece.done}")

    def close(self) -> None:
        self._files.close()
