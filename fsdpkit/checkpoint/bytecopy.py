"""Bounded-memory reads of large fragments with their crc32 checked, and casts between float
dtypes (no torch): loading, and `convert --to full`. Rank files of many small fragments
(`write_sharded`) are assembled by `gather.py` instead.

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
the source's running one (`crc.CrcShifter`) instead of a second pass. Callers must read each
fragment front to back (any number of calls, increasing ranges), which the plans in
`placement.py` guarantee; when a fragment's last byte has been read its crc32 is compared with
the manifest and a mismatch is a `DataCheckError`.
Peak memory: two chunk buffers, a cast buffer of the same order, cast temporaries of the same
order.

Speed: the default chunk (`DEFAULT_CHUNK_SIZE`, 512 KiB) is deliberately small. Each chunk is
read, checksummed and written while it is still in the CPU's L2 cache; with 4-64 MiB chunks
the same copy spent 3-10x longer in `write` (measured on a 2-core Xeon with a 2 MiB L2, page
cache to page cache, see benchmarks/checkpoint.py). Larger chunks only bound memory higher.

Casts (`cast_into`) work block by block with numpy (imported on first cast only),
rounding as torch does: round to nearest even, BF16 from F32 bits like c10's
`round_to_nearest_even` (NaN -> 0x7FC0), F64 -> BF16 or F16 through F32.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..errors import DataCheckError
from ..layout import ElementRange
from .crc import CrcShifter
from .format import dtype_info, numel

MAX_OPEN_FILES = 64
DEFAULT_CHUNK_SIZE = 512 * 1024
PROGRESS_BYTES = 8 * 1024 * 1024  # progress is reported in steps of this


def open_regular_file(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file (a FIFO or device would
    block or never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise DataCheckError(f"{path}: cannot read ({error.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataCheckError(f"{path}: not a regular file")
    return fd


class SourcePiece(NamedTuple):
    range: ElementRange  # elements of the tensor this piece holds
    path: Path
    offset: int  # absolute byte offset in `path` of element range.start
    nbytes: int  # bytes of the whole piece
    crc32: int | None  # of the whole piece's bytes; None when the source has no checksum
    key: str  # the tensor it belongs to (for messages)

    @property
    def label(self) -> str:
        return f"{self.path.name} tensor {self.key!r} [{self.range.start}, {self.range.end})"


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


class _OpenFiles:
    """A small LRU of read-only file descriptors (regular files only; never blocks on a FIFO)."""

    def __init__(self) -> None:
        self._fds: OrderedDict[Path, int] = OrderedDict()

    def fd(self, path: Path) -> int:
        if path in self._fds:
            self._fds.move_to_end(path)
            return self._fds[path]
        if len(self._fds) >= MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        fd = open_regular_file(path)
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
        self._crc: dict[tuple[Path, int], tuple[int, int, SourcePiece]] = {}  # piece -> (next byte, crc, piece)
        self._verified: set[tuple[Path, int]] = set()  # pieces read whole and checked (read_into)
        self._read_shifter = CrcShifter()  # used by the reading thread
        self._write_shifter = CrcShifter()  # used by the calling thread
        self._progress = progress
        self._unreported = 0

    def copy(
        self, tensor: SourceTensor, wanted: ElementRange, out_dtype: str, sink: Callable[[memoryview], None], *, checksum: bool = False
    ) -> int | None:
        """Stream elements `wanted` of `tensor`, cast to `out_dtype`, into `sink`; with `checksum`,
        return the crc32 of what was handed on."""
        blocks = self._blocks(tensor, wanted, dtype_info(tensor.dtype).itemsize)
        out_crc = 0
        if not blocks:
            return out_crc if checksum else None
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
                self._report(view.nbytes)
        return out_crc if checksum else None

    def read_into(self, tensor: SourceTensor, wanted: ElementRange, out: memoryview) -> None:
        """Random access (loading): the bytes of elements `wanted` of `tensor` into `out`. A piece
        with a checksum is read whole, and its crc32 checked, the first time any part of it is
        wanted; later reads of it take only the bytes wanted."""
        itemsize = dtype_info(tensor.dtype).itemsize
        if out.nbytes != wanted.size * itemsize:
            raise ValueError(f"{tensor.name}: {out.nbytes} bytes of room for {wanted.size} elements of {tensor.dtype}")
        for piece in tensor.pieces_in(wanted):
            part = piece.range.intersect(wanted)
            if piece.crc32 is not None and (piece.path, piece.offset) not in self._verified:
                base = piece.range.start * itemsize
                for first in range(0, piece.nbytes, self.chunk_size):
                    view, _ = self._read(piece, first, min(self.chunk_size, piece.nbytes - first), self._buffers[0])
                    lo = max(base + first, part.start * itemsize)
                    hi = min(base + first + view.nbytes, part.end * itemsize)
                    if lo < hi:
                        out[lo - wanted.start * itemsize : hi - wanted.start * itemsize] = view[lo - base - first : hi - base - first]
                self._verified.add((piece.path, piece.offset))
            else:
                start = (part.start - piece.range.start) * itemsize
                self._pread(piece, start, out[(part.start - wanted.start) * itemsize : (part.end - wanted.start) * itemsize])

    def _blocks(self, tensor: SourceTensor, wanted: ElementRange, itemsize: int) -> list[tuple[SourcePiece, int, int]]:
        """(piece, byte offset in the piece, bytes) of each chunk to read, in order."""
        step = max(1, self.chunk_size // itemsize)
        blocks = []
        for piece in tensor.pieces_in(wanted):
            part = piece.range.intersect(wanted)
            for first in range(part.start, part.end, step):
                last = min(first + step, part.end)
                blocks.append((piece, (first - piece.range.start) * itemsize, (last - first) * itemsize))
        return blocks

    def _read(self, piece: SourcePiece, offset: int, nbytes: int, buffer: bytearray) -> tuple[memoryview, int | None]:
        """Read `nbytes` of `piece` from byte `offset` into `buffer`; advance and check the piece's
        crc32. Returns the filled view and its own crc32 when known."""
        view = memoryview(buffer)[:nbytes]
        self._pread(piece, offset, view)
        return view, self._advance_crc(piece, offset, view, self._read_shifter, block_crc=True)

    def _advance_crc(self, piece: SourcePiece, offset: int, view: memoryview, shifter: CrcShifter, *, block_crc: bool) -> int | None:
        """Feed the bytes of `view` (at `offset` in the piece, being handed on) not yet checksummed
        into the piece's running crc32; compare it with the stored one when the piece has been
        read whole. Returns the crc32 of `view` itself when `block_crc` asks and it comes for free."""
        if piece.crc32 is None:
            return None
        key = (piece.path, piece.offset)
        position, crc, _ = self._crc.pop(key, (0, 0, piece))
        if offset > position:
            raise AssertionError(f"{piece.label}: read at byte {offset}, expected {position} (fragments must be read in order)")
        fresh = view[position - offset :]
        if not fresh.nbytes:
            self._crc[key] = (position, crc, piece)
            return None
        running = zlib.crc32(fresh, crc)
        own = running ^ shifter.shift(crc, fresh.nbytes) if block_crc and fresh.nbytes == view.nbytes else None
        position += fresh.nbytes
        if position < piece.nbytes:
            self._crc[key] = (position, running, piece)
        elif running != piece.crc32:
            raise DataCheckError(
                f"{piece.path}: checksum mismatch in {piece.label}: stored crc32 {piece.crc32:08x}, data gives {running:08x} (corrupt file)"
            )
        return own

    def _pread(self, piece: SourcePiece, offset: int, view: memoryview) -> None:
        """Fill `view` from byte `offset` of `piece`."""
        fd = self._files.fd(piece.path)
        done = 0
        while done < view.nbytes:
            count = os.preadv(fd, [view[done:]], piece.offset + offset + done)
            if count == 0:
                raise DataCheckError(f"{piece.path}: file ends before {piece.label} does (truncated)")
            done += count

    def _cast(self, view: memoryview, src_dtype: str, out_dtype: str) -> memoryview:
        if src_dtype == out_dtype:
            return view
        needed = self.chunk_size * dtype_info(out_dtype).itemsize // dtype_info(src_dtype).itemsize + 8
        if self._cast_buffer is None or len(self._cast_buffer) < needed:
            self._cast_buffer = bytearray(needed)
        return cast_into(view, src_dtype, out_dtype, self._cast_buffer)

    def _report(self, nbytes: int) -> None:
        if self._progress is not None:
            self._unreported += nbytes
            if self._unreported >= PROGRESS_BYTES:
                self._progress(self._unreported)
                self._unreported = 0

    def finish(self) -> None:
        """Close files; every piece started must have been read to its end."""
        self.close()
        for position, _, piece in self._crc.values():
            raise AssertionError(f"{piece.label}: read only up to byte {position}")

    def close(self) -> None:
        if self._progress is not None and self._unreported:
            self._progress(self._unreported)
            self._unreported = 0
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

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc) -> None:
        return None


# ----- float casts (numpy, imported on first use: a tenth of a second of startup)
CAST_BLOCK = 1 << 20  # elements per block


def cast_into(src: memoryview, src_dtype: str, dst_dtype: str, out: bytearray | memoryview) -> memoryview:
    """Cast the elements in `src` (bytes of `src_dtype`) into `out`; returns the used part of `out`."""
    import numpy as np

    src_size, dst_size = dtype_info(src_dtype).itemsize, dtype_info(dst_dtype).itemsize
    count = src.nbytes // src_size
    if src.nbytes % src_size:
        raise ValueError(f"{src.nbytes} bytes is not a whole number of {src_dtype} elements")
    out_view = memoryview(out)[: count * dst_size]
    if src_dtype == dst_dtype:
        out_view[:] = src
        return out_view
    src_array = np.frombuffer(src, dtype=np.uint8)
    out_array = np.frombuffer(out_view, dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the intended result, as in torch
        for first in range(0, count, CAST_BLOCK):
            last = min(first + CAST_BLOCK, count)
            block = src_array[first * src_size : last * src_size]
            _cast_block(np, block, src_dtype, dst_dtype, out_array[first * dst_size : last * dst_size])
    return out_view


def _to_f32(np, src, dtype: str):
    """F32 values of `src` (raw bytes): a view when already F32, else a new array."""
    if dtype == "BF16":
        return (src.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F32":
        return src.view(np.float32)
    return src.view(_numpy_float(np, dtype)).astype(np.float32)


def _numpy_float(np, dtype: str):
    return {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]


def _f32_to_bf16_into(np, values, out) -> None:
    """Round F32 `values` to nearest even BF16 bits in `out` (uint16), NaN -> 0x7FC0; one temporary."""
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += np.uint32(0x7FFF)
    rounded += bits  # wraps only for negative NaNs, fixed below
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0


def _cast_block(np, src, src_dtype: str, dst_dtype: str, out) -> None:
    """Cast raw bytes `src` into raw bytes `out` (both uint8 arrays of matching element counts)."""
    if dst_dtype == "BF16":
        values = src.view(np.float64).astype(np.float32) if src_dtype == "F64" else _to_f32(np, src, src_dtype)
        _f32_to_bf16_into(np, values, out.view(np.uint16))
    elif src_dtype == "BF16":
        np.copyto(out.view(_numpy_float(np, dst_dtype)), _to_f32(np, src, src_dtype), casting="unsafe")
    elif src_dtype == "F64" and dst_dtype == "F16":  # through F32, as torch rounds (twice)
        np.copyto(out.view(np.float16), src.view(np.float64).astype(np.float32), casting="unsafe")
    else:
        np.copyto(out.view(_numpy_float(np, dst_dtype)), src.view(_numpy_float(np, src_dtype)), casting="unsafe")
