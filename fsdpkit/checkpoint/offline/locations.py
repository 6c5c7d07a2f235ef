"""The offline commands at a location: a local path goes to the table of formats; an
object-store URL (`s3://`, `gs://`, `az://`) is read through the storage face, by the formats
that read through it so far (fsdpkit's own, version 2, and DCP). `convert` and `reshard` write to a URL
by writing the output into a local temporary directory (TMPDIR), then publishing it through the
face, the commit object last. A command or format that does not take URLs yet says so in one
line (UsageError), before anything is read."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ...errors import UsageError
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest, Keys, Progress, ReshardRequest, progress_callback
from ..core.summary import Summary
from ..dcp.stored import is_stored_dcp, summarize_stored_dcp, verify_stored_dcp
from ..format.stored import is_stored_sharded, summarize_stored, verify_stored
from ..storage.face import Storage
from ..storage.location import is_url, open_storage
from ..storage.upload import check_destination, publish

URL_READERS = "fsdpkit (version 2), DCP"  # the formats read from object storage so far


def verify_at(location: str | os.PathLike[str], progress: Progress | None = None) -> VerifyReport:
    """`verify`: every check the checkpoint's format allows, local or in an object store."""
    if not is_url(location):
        from .formats import detect_format

        return detect_format(location).verify(Path(location), progress)
    storage, listed = _listed(str(location))
    if is_stored_dcp(listed):
        return verify_stored_dcp(storage, listed)
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
    if is_stored_dcp(listed):
        return "dcp", summarize_stored_dcp(storage, listed, model_key=keys.model, optimizer_key=keys.optimizer)
    if not is_stored_sharded(listed):
        raise UsageError(f"{location}: no checkpoint fsdpkit reads from object storage yet ({URL_READERS}) under this prefix")
    return "sharded", summarize_stored(storage, listed)


def convert_at(src: str, dst: str, request: ConvertRequest, progress: Progress | None = None) -> WriteReport:
    """`convert` from a local source to a local directory or an object-store URL."""
    from .formats import convert_any

    if not is_url(dst):
        return convert_any(src, dst, request, progress)
    local_only(src, what="convert")
    return _published(dst, request.overwrite, lambda out: convert_any(src, out, request, progress))


def reshard_at(src: str, dst: str, request: ReshardRequest) -> WriteReport:
    """`reshard` from a local source to a local directory or an object-store URL."""
    from .formats import reshard_any

    if not is_url(dst):
        return reshard_any(src, dst, request)
    local_only(src, what="reshard")
    return _published(dst, request.overwrite, lambda out: reshard_any(src, out, request))


def _published(url: str, overwrite: bool, write: Callable[[Path], WriteReport]) -> WriteReport:
    """What `write` wrote into a local temporary directory, published at `url` through the face."""
    storage = open_storage(url)
    existing = check_destination(storage, overwrite=overwrite)
    with tempfile.TemporaryDirectory(prefix="fsdpkit-out-") as staging:
        out = Path(staging) / "out"
        report = write(out)
        publish(out, storage, existing)
    return dataclasses.replace(report, dst=url, files=[name.replace(str(out), url) for name in report.files])


def local_only(*locations: str | os.PathLike[str] | None, what: str) -> None:
    """A UsageError naming the first URL among `locations`: `what` does not take one yet."""
    for location in locations:
        if location is not None and is_url(location):
            raise UsageError(
                f"{location}: {what} does not take object-storage URLs yet (inspect and verify do, convert and reshard write to them); "
                "use a local directory"
            )


def _listed(url: str) -> tuple[Storage, dict[str, int]]:
    storage = open_storage(url)
    listed = storage.list()
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix")
    return storage, listed
