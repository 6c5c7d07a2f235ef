"""Output directories (no torch): a file kept inside its checkpoint directory, durable syncs, and
offline outputs (convert, reshard) written into a hidden temporary sibling that `staged_output`
renames to DST on success, after checking the destination, its permissions and its free space.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from ...errors import DataCheckError, RunError, UsageError
from ...paths import file_in_the_way, nearest_existing, unwritable_parent
from ...sizes import format_size
from ..storage.stored_path import StoredPath
from .files import source_path
from .names import TMP_PREFIX, is_safe_file_name


def checkpoint_file(step_dir: Path, name: str) -> Path:
    """`step_dir / name`, refusing names or symlinks that lead outside `step_dir`."""
    if not is_safe_file_name(name):
        raise DataCheckError(f"{step_dir}: file name {name!r} is not a plain file name inside the checkpoint")
    path = step_dir / name
    if path.is_symlink() and os.path.dirname(os.path.realpath(path)) != os.path.realpath(step_dir):
        raise DataCheckError(f"{path}: symlink points outside the checkpoint directory")
    return path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_files(directory: Path, names: list[str]) -> None:
    """Make files `names` in `directory`, and the directory, durable: many files by one syncfs(2)
    of their filesystem instead of an open and an fsync each; few files, or no syncfs: fsync each."""
    if len(names) <= SYNCFS_FILES or not _syncfs(directory):
        for name in names:
            fsync_dir(directory / name)
    fsync_dir(directory)


SYNCFS_FILES = 16


def _syncfs(directory: Path) -> bool:
    """syncfs(2) on `directory`'s filesystem; False where the C library has none."""
    try:
        import ctypes

        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(directory, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), str(directory))
    finally:
        os.close(fd)
    return True


def os_error_line(error: OSError, where: Path | str) -> str:
    """One line for an OSError: the path, the reason and the errno's name."""
    name = errno.errorcode.get(error.errno, str(error.errno)) if error.errno else "?"
    return f"{error.filename or where}: {error.strerror or error} ({name})"


NAME_MAX = 255  # bytes of one file name (Linux, macOS)
SIBLING_NAME_EXTRA = len(f"{TMP_PREFIX}old--12345678")  # the longest name written beside DST adds this to DST's


def check_destination_name(dst: Path) -> None:
    """A UsageError when the temporary names written beside `dst` (`.tmp-old-DST-12345678`, a
    spread run's `.tmp-DST-resumable`) would be longer than a file name can be."""
    length = len(os.fsencode(dst.name))
    if length + SIBLING_NAME_EXTRA > NAME_MAX:
        raise UsageError(
            f"destination name {dst.name[:40]}... is {length} bytes long: at most {NAME_MAX - SIBLING_NAME_EXTRA} "
            f"(a file name holds {NAME_MAX}, and the temporary names written beside it add {SIBLING_NAME_EXTRA}); nothing written"
        )


def check_destination(dst: Path, *, src: Path, overwrite: bool) -> None:
    """A local `dst` that may be written: a name short enough, outside the source `src` (a
    checkpoint in a storage is outside every local directory), and absent or a directory
    `overwrite` may replace."""
    check_destination_name(dst)
    # a directory, or a single file (a full checkpoint's .safetensors or index); no local path starts with a NUL
    src_root = os.path.realpath(src) if not isinstance(src, StoredPath) else "\0"
    dst_real = os.path.realpath(dst)
    if dst_real == src_root or dst_real.startswith(src_root + os.sep):
        raise UsageError(f"destination {dst} is inside the source {src}; choose a directory outside it")
    if src_root.startswith(dst_real + os.sep):
        raise UsageError(f"destination {dst} contains the source {src}; choose another directory")
    if dst.exists() or dst.is_symlink():
        if not overwrite:
            raise UsageError(f"destination {dst} already exists; pass --overwrite to replace it")
        if not dst.is_dir():
            raise UsageError(f"destination {dst} exists and is not a directory")


def check_free_space(directory: Path, needed_bytes: int, *, needed_for: str = "") -> None:
    """Room for `needed_bytes` (`needed_for`: what they are, for the message). More than the
    whole filesystem holds is a UsageError; more than is free, a RunError."""
    usage = shutil.disk_usage(directory)
    need = f"need {format_size(needed_bytes)}{needed_for}"
    if usage.total < needed_bytes * 1.01:
        raise UsageError(f"the output cannot fit in {directory}: {need}, its whole filesystem holds {format_size(usage.total)}")
    if usage.free < needed_bytes * 1.01:
        raise RunError(f"not enough disk space in {directory}: {need}, {format_size(usage.free)} free")


def read_only_line(directory: Path, error_number: int | None = None) -> str:
    """One line saying that `directory` (or, when absent, its nearest existing parent) is read-only."""
    directory = Path(nearest_existing(directory))
    if error_number is None:
        try:
            error_number = errno.EROFS if os.statvfs(directory).f_flag & os.ST_RDONLY else errno.EACCES
        except OSError:
            error_number = errno.EACCES
    why = "a read-only filesystem" if error_number == errno.EROFS else "no write permission for this user"
    return f"destination directory {directory} is read-only: {why} ({errno.errorcode[error_number]}); nothing written"


@contextlib.contextmanager
def staged_output(dst: str | Path, *, src: str | Path, overwrite: bool, needed_bytes: int, needed_for: str = "") -> Iterator[Path]:
    dst = Path(dst)
    check_destination(dst, src=source_path(src), overwrite=overwrite)
    parent = dst.absolute().parent
    token = uuid.uuid4().hex[:8]
    tmp = parent / f"{TMP_PREFIX}{dst.name}-{token}"
    if (blocker := file_in_the_way(parent)) is not None:
        raise UsageError(f"destination {dst} cannot be created: {blocker} is a file, not a directory; nothing written")
    if (unwritable := unwritable_parent(parent)) is not None:
        raise UsageError(read_only_line(Path(unwritable)))
    try:
        parent.mkdir(parents=True, exist_ok=True)
        check_free_space(parent, needed_bytes, needed_for=needed_for)
        tmp.mkdir()
    except OSError as error:
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):  # what os.access could not tell (a race, a network filesystem)
            raise UsageError(read_only_line(Path(error.filename or parent), error.errno)) from None
        raise RunError(f"cannot write to {parent}: {os_error_line(error, parent)}") from None
    try:
        yield tmp
        sync_files(tmp, [entry.name for entry in os.scandir(tmp) if entry.is_file()])
        if (dst.exists() or dst.is_symlink()) and not overwrite:
            raise UsageError(f"destination {dst} appeared while the conversion ran; pass --overwrite to replace it; nothing written")
        if dst.exists() or dst.is_symlink():  # what DST held goes aside, then away once DST is the output
            old = parent / f"{TMP_PREFIX}old-{dst.name}-{token}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            fsync_dir(parent)
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        else:
            os.rename(tmp, dst)
        fsync_dir(parent)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RunError(f"writing {dst} failed, nothing written: {os_error_line(error, tmp)}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
