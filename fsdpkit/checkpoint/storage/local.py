"""The storage face over a local directory: positional reads into one reused buffer, writes
into a hidden temporary file renamed into place once fsynced, `O_EXCL` for the conditional
create. Local checkpoints keep their fast path (mapped windows, kernel copies) through
`path`, which only this storage answers."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import uuid
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path

from ...errors import DataCheckError, RunError
from .face import READ_BLOCK_BYTES
from .names import checked_name


class LocalStorage:
    def __init__(self, root: str | os.PathLike[str]):
        self._root = Path(root)
        self.root = str(root)

    def path(self, name: str) -> Path:
        """The file of object `name` (the local fast path: mapped windows, kernel copies)."""
        return self._root / checked_name(name, self.root) if name else self._root

    def where(self, name: str) -> str:
        return str(self.path(name))

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self.path(name))

    def size(self, name: str) -> int | None:
        try:
            info = os.stat(self.path(name))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def read(self, name: str, start: int = 0, end: int | None = None) -> bytes:
        with self._open(name) as (fd, size):
            end = size if end is None else end
            data = os.pread(fd, end - start, start)
            if len(data) < end - start:  # pread returns short reads only at the end of the file
                raise DataCheckError(f"{self.where(name)}: file ends at byte {start + len(data)}, {end - start - len(data)} bytes early")
            return data

    def read_blocks(
        self, name: str, ranges: Iterable[tuple[int, int]], *, block_bytes: int = READ_BLOCK_BYTES
    ) -> Generator[tuple[int, memoryview], None, None]:
        buffer = memoryview(bytearray(block_bytes))
        with self._open(name) as (fd, _):
            for start, end in ranges:
                while start < end:
                    block = buffer[: min(block_bytes, end - start)]
                    count = os.preadv(fd, [block], start)
                    if count == 0:
                        raise DataCheckError(f"{self.where(name)}: file ends at byte {start}, {end - start} bytes early (truncated)")
                    yield start, block[:count]
                    start += count

    @contextlib.contextmanager
    def _open(self, name: str) -> Iterator[tuple[int, int]]:
        path = self.path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise DataCheckError(f"{path}: file is missing") from None
        except OSError as error:
            raise DataCheckError(f"{path}: cannot read ({error.strerror})") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise DataCheckError(f"{path}: not a regular file")
            yield fd, info.st_size
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> dict[str, int]:
        top = self.path(prefix) if prefix else self._root
        found: dict[str, int] = {}
        for directory, _, files in os.walk(top):
            relative = Path(directory).relative_to(self._root).as_posix()
            for file in files:
                name = file if relative == "." else f"{relative}/{file}"
                with contextlib.suppress(FileNotFoundError):
                    found[name] = os.stat(os.path.join(directory, file)).st_size
        return found

    @contextlib.contextmanager
    def write(self, name: str) -> Iterator[_FileStream]:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as file:
                yield _FileStream(file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            raise RunError(f"writing {path} failed, nothing committed: {error.strerror or error}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def put(self, name: str, data: bytes) -> None:
        with self.write(name) as stream:
            stream.write(data)

    def commit(self, name: str, data: bytes) -> None:
        self.put(name, data)
        fd = os.open(self.path(name).parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        return True

    def delete(self, names: Iterable[str]) -> None:
        for name in names:
            path = self.path(name)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


class _FileStream:
    def __init__(self, file):
        self._file = file

    def write(self, data: bytes | memoryview, /) -> int:
        return self._file.write(data)
