"""The storage face: the one interface every byte of checkpoint content goes through, local
directory or object store. Names are `/`-separated keys relative to the storage's root (a
directory, or a URL's prefix); a storage never sees a path outside its root.

- `read_blocks` streams byte ranges of one object front to back, in blocks of at most
  `block_bytes`, several requests in flight, issued in offset order, a few blocks held: memory
  is bounded whatever the object's size, and each byte is fetched once.
- `write` is a stream into one object, which appears only when the stream ends without an
  error (an object store's multipart upload is aborted on an error).
- `commit` writes the object that makes a checkpoint whole (a manifest, DCP's `.metadata`,
  DeepSpeed's `latest`); it is the last object written, never a rename.
- `create_exclusive` makes an object only where none is (`If-None-Match: *` on object stores):
  the one-writer lock.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import AbstractContextManager
from typing import Protocol

READ_BLOCK_BYTES = 8 << 20  # a block handed to the reader
PART_BYTES = 8 << 20  # one part of a multipart upload
PARTS_IN_FLIGHT = 8  # parts uploaded at once: at most PARTS_IN_FLIGHT * PART_BYTES held


class WriteStream(Protocol):
    def write(self, data: bytes | memoryview, /) -> int:
        """Append `data`; the caller may reuse its buffer as soon as this returns."""
        ...


class Storage(Protocol):
    root: str  # the directory or URL, for messages

    def where(self, name: str) -> str:
        """The path or URL of object `name`, for messages."""
        ...

    def child(self, name: str) -> Storage:
        """The storage rooted at `name` (a sub-directory, a longer prefix)."""
        ...

    def size(self, name: str) -> int | None:
        """The size of object `name`; None when there is none."""
        ...

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) of object `name` (to its end without `end`): one request."""
        ...

    def read_blocks(
        self, name: str, ranges: Iterable[tuple[int, int]], *, block_bytes: int = READ_BLOCK_BYTES
    ) -> Generator[tuple[int, memoryview], None, None]:
        """(offset, bytes) of `ranges` of object `name` in order, blocks of at most `block_bytes`;
        a block is valid until the next is taken."""
        ...

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under directory `prefix` (recursively, whole path parts): name -> size."""
        ...

    def write(self, name: str) -> AbstractContextManager[WriteStream]:
        """A stream into object `name`, which appears when the block ends without an error."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """Object `name` holding `data`, written whole."""
        ...

    def commit(self, name: str, data: bytes) -> None:
        """The object that makes what was written before it a whole checkpoint, durable."""
        ...

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Object `name` holding `data` if no object `name` exists (True), else nothing (False)."""
        ...

    def delete(self, names: Iterable[str]) -> None:
        """Remove objects `names`; those already gone are no error."""
        ...
