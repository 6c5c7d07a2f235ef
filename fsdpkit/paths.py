"""Checks, before anything starts, that an output path can be written: a flag naming a
directory or a file nobody may write is one line (UsageError) before a process is launched,
not a traceback at the end of a run. `os.access` answers for the real user, and says no on a
read-only filesystem even to root."""

from __future__ import annotations

import os

from .errors import UsageError


def check_writable_directory(path: str, flag: str) -> None:
    """`path` is a writable directory, or can be created as one (its nearest existing parent
    is a writable directory)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise UsageError(f"{flag} {path!r} exists and is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path!r} is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
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
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path!r}: directory {directory!r} is not writable")
