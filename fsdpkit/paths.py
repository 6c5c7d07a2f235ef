"""Checks, before anything starts, that an output path can be written: a flag naming a
directory or a file nobody may write is one line (UsageError) before a process is launched,
not a traceback at the end of a run; the offline commands' outputs (checkpoint/format/storage.py) ask
`unwritable_parent` too. `os.access` answers for the real user, and says no on a read-only
filesystem even to root."""

from __future__ import annotations

import os

from .errors import UsageError


def nearest_existing(path: str | os.PathLike) -> str:
    """`path` made absolute, or its nearest existing parent when it does not exist."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path


def is_writable_directory(path: str | os.PathLike) -> bool:
    """New entries can be made in the existing directory `path` by this user."""
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def unwritable_parent(path: str | os.PathLike) -> str | None:
    """What stops a directory from being created at `path` (or written into, when it exists):
    `path` itself or its nearest existing parent, when that is not a writable directory; None
    when nothing does."""
    existing = nearest_existing(path)
    return None if is_writable_directory(existing) else existing


def file_in_the_way(path: str | os.PathLike) -> str | None:
    """The existing non-directory (a regular file, a FIFO...) at `path` or above it that stops a
    directory from being made at `path`; None when there is none."""
    existing = nearest_existing(path)
    return existing if os.path.exists(existing) and not os.path.isdir(existing) else None


def check_writable_directory(path: str, flag: str) -> None:
    """`path` is a writable directory, or can be created as one."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{flag} {path!r} exists and is not a directory")
        if not is_writable_directory(path):
            raise UsageError(f"{flag} {path!r} is not writable")
        return
    if (blocker := file_in_the_way(path)) is not None:
        raise UsageError(f"{flag} {path!r} cannot be created: {blocker!r} is a file, not a directory")
    parent = unwritable_parent(path)
    if parent is not None:
        raise UsageError(f"{flag} {path!r} cannot be created: {parent!r} is not a writable directory")


def check_writable_file(path: str, flag: str) -> None:
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory, expected a file name")
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path!r} is not writable")
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise UsageError(f"{flag} {path!r}: directory {directory!r} does not exist")
    if not is_writable_directory(directory):
        raise UsageError(f"{flag} {path!r}: directory {directory!r} is not writable")
