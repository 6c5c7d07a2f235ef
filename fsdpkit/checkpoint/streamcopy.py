"""Bounded-memory byte copies from source fragments to an output stream (no torch).

A `SourceTensor` says where each element range of a tensor lies: (range, file, byte offset,
crc32 or None). Sharded checkpoints give one piece per fragment (with its checksum); full
safetensors files give one piece per tensor (no checksum).

`ByteCopier.copy(tensor, wanted_range, out_dtype, sink, checksum=...)` reads the overlapping
pieces, one chunk at a time, into two reused buffers of `chunk_size` bytes with `os.preadv`
(a second thread reads and checksums chunk i+1 while the caller's thread casts and writes
chunk i: `preadv`, `zlib.crc32` and `write` all release the GIL), updates the running
crc32 of every source fragment it reads, casts floats when `out_dtype` differs, and hands
each filled view to `sink`; with `checksum=True` it returns the crc32 of all the bytes it
handed on. Each block is checksummed once, on the bytes that are written: when both a
source and an output checksum run over uncast bytes, the block's own crc is derived from
the source's running one (`crc.py`) instead of a second pass. Callers must read each
fragment front to back (any number of calls, increasing ranges), which the plans in
`plan.py` guarantee; when a fragment's last byte has been read its crc32 is compared with
the manifest and a mismatch is a `DataCheckError`.
Peak memory: two chunk buffers, a cast buffer of the same order, cast temporaries of the same
order.

Speed: the default chunk (`DEFAULT_CHUNK_SIZE`, 512 KiB) is deliberately small. Each chunk is
read, checksummed and written while it is still in the CPU's L2 cache; with 4-64 MiB chunks
the same copy spent 3-10x longer in `write` (measured on a 2-core Xeon with a 2 MiB L2, page
cache to page cache, see benchmarks/checkpoint.py). Larger chunks only bound memory higher.
"""

from __future__ import annotations

import os
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import DataCheckError
from ..layout import ElementRange
from .crc import CrcShifter
from .format import dtype_info, numel

MAX_OPEN_FILES = 64
DEFAULT_CHUNK_SIZE = 512 * 1024


@dataclass(frozen=True)
class SourcePiece:
    range: ElementRange  # elements of the tensor this piece holds
    path: Path
    offset: int  # absolute byte offset in `path` of element range.start
    nbytes: int  # bytes of the whole piece
    crc32: int | None  # of the whole piece's bytes; None when the source has no checksum
    label: str  # how to name it in an error (file and key)


@dataclass(frozen=True)
class SourceTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[SourcePiece, ...]

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype).itemsize


class _OpenFiles:
    """A small LRU of read-only file descriptors."""

    def __init__(self) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()

    def fd(self, path: Path) -> int:
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        fd = os.open(path, os.O_RDONLY)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger readahead when not cached
        self._fds[path] = fd
        return fd

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])


class ByteCopier:
    def __init__(self, *, chunk_size: int, progress: Callable[[int], None] | None = None):
        if chunk_size < 64:
            raise ValueError(f"chunk size must be at least 64 bytes, got {chunk_size}")
        self.chunk_size = chunk_size
        self._buffers = (bytearray(chunk_size), bytearray(chunk_size))  # one being read, one being written
        self._cast_buffer: bytearray | None = None
        self._files = _OpenFiles()
        self._crc: dict[tuple[Path, int], tuple[int, int]] = {}  # piece -> (bytes read, running crc)
        self._read_shifter = CrcShifter()  # used by the reading thread
        self._write_shifter = CrcShifter()  # used by the calling thread
        self._progress = progress

    def copy(self, tensor: SourceTensor, wanted: ElementRange, out_dtype: str, sink: Callable[[memoryview], None],
             *, checksum: bool = False) -> int | None:
        blocks = self._blocks(tensor, wanted)
        if not blocks:
            return 0 if checksum else None
        out_crc = 0
        with ThreadPoolExecutor(max_workers=1) if len(blocks) > 1 else _Inline() as reader:
            pending = reader.submit(self._read, *blocks[0], self._buffers[0])
            for index in range(len(blocks)):
                view, block_crc = pending.result()
                if index + 1 < len(blocks):  # read (and checksum) the next block while this one is written
                    pending = reader.submit(self._read, *blocks[index + 1], self._buffers[(index + 1) % 2])
                out = self._cast(view, tensor.dtype, out_dtype)
                sink(out)
                if checksum:
                    if out is view and block_crc is not None:
                        out_crc = self._write_shifter.combine(out_crc, block_crc, out.nbytes)
                    else:
                        out_crc = zlib.crc32(out, out_crc)
                if self._progress:
                    self._progress(view.nbytes)
        return out_crc if checksum else None

    def _blocks(self, tensor: SourceTensor, wanted: ElementRange) -> list[tuple[SourcePiece, int, int]]:
        """(piece, byte offset in the piece, bytes) of each chunk to read, in order."""
        itemsize = dtype_info(tensor.dtype).itemsize
        step = max(1, self.chunk_size // itemsize)
        blocks = []
        for piece in tensor.pieces:
            part = piece.range.intersect(wanted)
            for first in range(part.start, part.end, step):
                last = min(first + step, part.end)
                blocks.append((piece, (first - piece.range.start) * itemsize, (last - first) * itemsize))
        return blocks

    def _read(self, piece: SourcePiece, offset: int, nbytes: int, buffer: bytearray) -> tuple[memoryview, int | None]:
        """Read `nbytes` of `piece` from byte `offset` into `buffer`; advance and check the piece's
        crc32. Returns the filled view and its own crc32 (None when the piece has no checksum)."""
        view = memoryview(buffer)[:nbytes]
        fd = self._files.fd(piece.path)
        done = 0
        while done < view.nbytes:
            count = os.preadv(fd, [view[done:]], piece.offset + offset + done)
            if count == 0:
                raise DataCheckError(f"{piece.path}: file ends before {piece.label} does (truncated)")
            done += count
        if piece.crc32 is None:
            return view, None
        key = (piece.path, piece.offset)
        position, crc = self._crc.pop(key, (0, 0))
        if offset != position:
            raise AssertionError(f"{piece.label}: read at byte {offset}, expected {position} (fragments must be read in order)")
        running = zlib.crc32(view, crc)
        block_crc = running ^ self._read_shifter.shift(crc, view.nbytes)  # crc(A + B) = shift(crc(A), |B|) ^ crc(B)
        position += view.nbytes
        if position < piece.nbytes:
            self._crc[key] = (position, running)
        elif running != piece.crc32:
            raise DataCheckError(f"{piece.path}: checksum mismatch in {piece.label}: "
                                 f"stored crc32 {piece.crc32:08x}, data gives {running:08x} (corrupt file)")
        return view, block_crc

    def _cast(self, view: memoryview, src_dtype: str, out_dtype: str) -> memoryview:
        if src_dtype == out_dtype:
            return view
        needed = self.chunk_size * dtype_info(out_dtype).itemsize // dtype_info(src_dtype).itemsize + 8
        if self._cast_buffer is None or len(self._cast_buffer) < needed:
            self._cast_buffer = bytearray(needed)
        from .cast import cast_into  # numpy: imported only when casting (a tenth of a second of startup)

        return cast_into(view, src_dtype, out_dtype, self._cast_buffer)

    def finish(self) -> None:
        """Check that every fragment that was started was read to its end; close files."""
        self._files.close()
        if self._crc:
            (path, _), (position, _) = next(iter(self._crc.items()))
            raise AssertionError(f"{path}: a fragment was read only up to byte {position}")

    def close(self) -> None:
        self._files.close()


class _Inline:
    """A stand-in for a one-worker executor that runs the call at once (single-block copies)."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as error:
            future.set_exception(error)
        return future

    def __enter__(self) -> "_Inline":
        return self

    def __exit__(self, *exc) -> None:
        return None
