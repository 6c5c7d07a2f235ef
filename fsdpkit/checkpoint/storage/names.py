"""Object names inside a storage: `/`-separated, relative, no empty, `.` or `..` part, so no
name reaches outside the storage's root."""

from __future__ import annotations

from ...errors import DataCheckError


def checked_name(name: str, root: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(part in ("", ".", "..") or "\\" in part or "\0" in part for part in parts):
        raise DataCheckError(f"{root}: object name {name!r} is not a plain name inside the checkpoint")
    return name
