"""The offline commands at a location: a local path goes to the table of formats; an
object-store URL (`s3://`, `gs://`, `az://`) is read through the storage face, by the formats
that read through it so far (fsdpkit's own, version 2). A command or format that does not take
URLs yet says so in one line (UsageError), before anything is read."""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import UsageError
from ..format.report import VerifyReport
from ..format.stored import is_stored_sharded, summarize_stored, verify_stored
from ..format.summary import Summary
from ..storage.face import Storage
from ..storage.location import is_url, open_storage
from .request import Keys, Progress, progress_callback

URL_READERS = "fsdpkit (version 2)"  # the formats read from object storage so far


def verify_at(location: str | os.PathLike[str], progress: Progress | None = None) -> VerifyReport:
    """`verify`: every check the checkpoint's format allows, local or in an object store."""
    if not is_url(location):
        from .formats import detect_format

        return detect_format(location).verify(Path(location), progress)
    storage, listed = _listed(str(location))
    if not is_stored_sharded(listed):
        raise UsageError(f"{location}: no checkpoint fsdpkit reads from object storage yet ({URL_READERS}) under this prefix")
    total = sum(size for name, size in listed.items() if name.rpartition("/")[2].startswith("rank-"))
    return verify_stored(storage, listed, progress_callback(progress, total))


def inspect_at(location: str | os.PathLike[str], keys: Keys) -> tuple[str, Summary]:
    """`inspect`: (the format's name, the summary) of the checkpoint at `location`."""
    if not is_url(location):
        from .formats import detect_format

        found = detect_format(location)
        return found.name, found.inspect(Path(location), keys)
    storage, listed = _listed(str(location))
    if not is_stored_sharded(listed):
        raise UsageError(f"{location}: no checkpoint fsdpkit reads from object storage yet ({URL_READERS}) under this prefix")
    return "sharded", summarize_stored(storage, listed)


def local_only(*locations: str | os.PathLike[str] | None, what: str) -> None:
    """A UsageError naming the first URL among `locations`: `what` does not take one yet."""
    for location in locations:
        if location is not None and is_url(location):
            raise UsageError(f"{location}: {what} does not take object-storage URLs yet (inspect and verify do); use a local directory")


def _listed(url: str) -> tuple[Storage, dict[str, int]]:
    storage = open_storage(url)
    listed = storage.list()
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix")
    return storage, listed
