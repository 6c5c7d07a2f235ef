"""A checkpoint in a storage named as a path (`StoredPath`), so the readers of every format read a
bucket in place as they read a local directory: the objects are listed once, and `exists`,
`is_dir`, `iterdir`, `glob` and `stat` answer from that listing; the bytes are read through the
face only (`core/files.py` opens a stored path as an `ObjectHandle`). It is no `os.PathLike`:
`open()`, `os.*` and `Path(...)` refuse it, so no local file is ever read in its place."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import NamedTuple

from ...errors import DataCheckError
from .face import Storage
from .handle import BlockCache, ObjectHandle

SHARED_BLOCKS = 64  # header blocks the handles of one listed checkpoint keep between them (16 MiB)


class _Listing:
    """The objects under a storage's root (name -> size), and the directories they imply."""

    def __init__(self, storage: Storage, listed: dict[str, int]):
        self.storage, self.sizes = storage, listed
        self.blocks = BlockCache(SHARED_BLOCKS)
        self.directories = {""}
        for name in listed:
            parts = name.split("/")[:-1]
            self.directories.update("/".join(parts[: i + 1]) for i in range(len(parts)))


class Stat(NamedTuple):
    st_size: int


class StoredPath:
    """Object or directory `key` ("" for the root) of a listed storage."""

    __slots__ = ("_listing", "key")

    def __init__(self, listing: _Listing, key: str):
        self._listing, self.key = listing, key

    @property
    def storage(self) -> Storage:
        return self._listing.storage

    def __truediv__(self, name: str | PurePosixPath) -> StoredPath:
        joined = PurePosixPath(self.key or ".", str(name)).as_posix()
        return StoredPath(self._listing, "" if joined == "." else joined)

    joinpath = __truediv__

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix if self.name else ""

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem if self.name else ""

    @property
    def parent(self) -> StoredPath:
        return StoredPath(self._listing, self.key.rpartition("/")[0])

    def relative_to(self, other: StoredPath) -> PurePosixPath:
        return PurePosixPath(self.key or ".").relative_to(other.key or ".")

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        return self.key in self._listing.sizes

    def is_dir(self) -> bool:
        return self.key in self._listing.directories

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[StoredPath]:
        if not self.is_dir():
            raise DataCheckError(f"{self}: not a directory")
        prefix = f"{self.key}/" if self.key else ""
        children = {name[len(prefix) :].partition("/")[0] for name in self._listing.sizes if name.startswith(prefix)}
        return iter([self / child for child in sorted(children)])

    def glob(self, pattern: str) -> Iterator[StoredPath]:
        """Children whose name matches `pattern` (one level, no `**`)."""
        return (child for child in self.iterdir() if fnmatch.fnmatchcase(child.name, pattern))

    def stat(self) -> Stat:
        size = self._listing.sizes.get(self.key)
        if size is None:
            raise DataCheckError(f"{self}: file is missing")
        return Stat(size)

    def read_bytes(self) -> bytes:
        self.stat()
        return self.storage.read(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        self.stat()
        return self.storage.read(self.key).decode(encoding)

    def handle(self) -> tuple[ObjectHandle, int]:
        """(handle, size) of this object, read through the face."""
        if self.is_dir() and not self.is_file():
            raise DataCheckError(f"{self}: is a directory, expected a file")
        size = self._listing.sizes.get(self.key)
        if size is None:
            raise DataCheckError(f"{self}: file is missing")
        return ObjectHandle(self.storage, self.key, size, self._listing.blocks), size

    def __str__(self) -> str:
        return self.storage.where(self.key)

    def __repr__(self) -> str:
        return f"StoredPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoredPath) and other._listing is self._listing and other.key == self.key

    def __hash__(self) -> int:
        return hash((id(self._listing), self.key))

    def __lt__(self, other: StoredPath) -> bool:
        return self.key < other.key


def stored_root(storage: Storage, listed: dict[str, int]) -> StoredPath:
    """The root of `storage` (whose objects are `listed`, name -> size) as a path."""
    return StoredPath(_Listing(storage, listed), "")
