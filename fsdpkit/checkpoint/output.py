"""Writing a whole output directory atomically (convert and reshard).

`staged_output(dst, src=..., overwrite=..., needed_bytes=...)` refuses, before anything is
written: DST equal to, inside, or containing SRC; an existing DST without `overwrite`; less
free disk than `needed_bytes` (plus 1%) on DST's filesystem. It yields a hidden temporary
sibling directory; on success the files and the directory are fsynced and it is renamed to
DST (an old DST, with `overwrite`, is moved aside first and removed after). On any error the
temporary directory is removed: no partial DST is ever left under the final name.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from ..errors import RunError, UsageError
from ..sizes import format_size
from .format import TMP_PREFIX


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file directly in `path`, then `path` itself."""
    for child in path.iterdir():
        if child.is_file():
            fd = os.open(child, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def check_destination(dst: Path, *, src: Path, overwrite: bool) -> None:
    src_root = os.path.realpath(src)  # a directory, or a single file (a full checkpoint's .safetensors or index)
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


def check_free_space(directory: Path, needed_bytes: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed_bytes * 1.01:
        raise RunError(f"not enough disk space in {directory}: need {format_size(needed_bytes)}, "
                       f"{format_size(free)} free")


@contextlib.contextmanager
def staged_output(dst: str | Path, *, src: str | Path, overwrite: bool, needed_bytes: int) -> Iterator[Path]:
    dst, src = Path(dst), Path(src)
    check_destination(dst, src=src, overwrite=overwrite)
    parent = dst.absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"cannot create {parent}: {error.strerror}") from None
    check_free_space(parent, needed_bytes)
    token = uuid.uuid4().hex[:8]
    tmp = parent / f"{TMP_PREFIX}{dst.name}-{token}"
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        if dst.exists() or dst.is_symlink():
            old = parent / f"{TMP_PREFIX}old-{dst.name}-{token}"
            os.rename(dst, old)
            os.rename(tmp, dst)
            fsync_dir(parent)
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
        else:
            os.rename(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
