"""An object of a storage read at offsets as a file descriptor is (`pread`), for the readers
that parse headers, zip directories and pickles at scattered offsets (DCP's chunks): each read
is a ranged GET through the face, and aligned blocks of BLOCK_BYTES around small reads are
kept (at most KEPT_BLOCKS), since such parsers read many small pieces close together.

The byte engine reads tensor bytes through `window` instead: one streamed GET per run of
forward reads (the face's `read_blocks`: requests in offset order, a few blocks read ahead), so
a conversion that reads a file front to back fetches each byte once in one request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from ...errors import DataCheckError
from .face import Storage

BLOCK_BYTES = 256 << 10
KEPT_BLOCKS = 16  # at most 4 MiB held per object
STREAM_BLOCK_BYTES = 1 << 20  # a block of a window's stream
SKIP_BYTES = 4 << 20  # a gap in forward reads up to this is read through; a longer one starts a new GET


class ObjectHandle:
    def __init__(self, storage: Storage, name: str, size: int):
        self.storage, self.name, self.size = storage, name, size
        self._blocks: OrderedDict[int, bytes] = OrderedDict()
        self._stream: Iterator[tuple[int, memoryview]] | None = None  # the GET windows are read from
        self._held, self._held_start, self._streamed = bytearray(), 0, 0  # bytes [held_start, streamed) of it

    def pread(self, count: int, offset: int) -> bytes:
        """Bytes [offset, offset + count), fewer only where the object ends."""
        end = min(offset + count, self.size)
        if end <= offset:
            return b""
        if end - offset > BLOCK_BYTES:
            return self.storage.read(self.name, offset, end)
        first, last = offset // BLOCK_BYTES, (end - 1) // BLOCK_BYTES
        data = b"".join(self._block(index) for index in range(first, last + 1))
        return data[offset - first * BLOCK_BYTES : end - first * BLOCK_BYTES]

    def window(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset + length), fewer where the object ends, from the stream of the
        windows before it when it starts at or after theirs (a gap of at most SKIP_BYTES read
        through), else from a new streamed GET that runs from `offset` to the object's end."""
        end = min(offset + length, self.size)
        if self._stream is None or offset < self._held_start or offset > self._streamed + SKIP_BYTES:
            self.close()
            self._stream = self.storage.read_blocks(self.name, [(offset, self.size)], block_bytes=STREAM_BLOCK_BYTES)
            self._held_start = self._streamed = offset
        while self._streamed < end:
            _, block = next(self._stream)
            self._held += block
            self._streamed += len(block)
        del self._held[: offset - self._held_start]  # windows move forward: what is before this one is done
        self._held_start = offset
        return bytes(self._held[: end - offset])

    def close(self) -> None:
        """End the stream of windows (its GET and read-ahead)."""
        stream, self._stream = self._stream, None
        end = getattr(stream, "close", None)  # a generator's: its finally stops the GETs in flight
        if end is not None:
            end()
        self._held = bytearray()

    def _block(self, index: int) -> bytes:
        block = self._blocks.get(index)
        if block is None:
            start = index * BLOCK_BYTES
            block = self._blocks[index] = self.storage.read(self.name, start, min(start + BLOCK_BYTES, self.size))
            if len(self._blocks) > KEPT_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(index)
        return block


def open_handle(storage: Storage, name: str) -> tuple[ObjectHandle, int]:
    """(handle, size) of object `name`; a DataCheckError when there is none."""
    size = storage.size(name)
    if size is None:
        raise DataCheckError(f"{storage.where(name)}: file is missing")
    return ObjectHandle(storage, name, size), size
