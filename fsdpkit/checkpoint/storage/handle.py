"""An object of a storage read at offsets as a file descriptor is (`pread`), for the readers
that parse headers, zip directories and pickles at scattered offsets (DCP's chunks): each read
is a ranged GET through the face, and aligned blocks of BLOCK_BYTES around small reads are
kept (at most KEPT_BLOCKS), since such parsers read many small pieces close together."""

from __future__ import annotations

from collections import OrderedDict

from ...errors import DataCheckError
from .face import Storage

BLOCK_BYTES = 256 << 10
KEPT_BLOCKS = 16  # at most 4 MiB held per object


class ObjectHandle:
    def __init__(self, storage: Storage, name: str, size: int):
        self.storage, self.name, self.size = storage, name, size
        self._blocks: OrderedDict[int, bytes] = OrderedDict()

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
