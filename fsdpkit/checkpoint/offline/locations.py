"""The offline commands at a location: a local path goes to the registry of formats; an
object-store URL (`s3://`, `gs://`, `az://`) is read in place through the storage face, by the
same readers (`source_at`: the URL's objects as a `StoredPath`): nothing of a source is copied
to local disk. `verify` and `inspect` of fsdpkit's format (version 2) and DCP have stored
readers of their own (several objects at once). `convert_at` and `reshard_at` write to a URL
by writing the output into a local temporary directory, then publishing it through the face,
the commit object last: the commands stream to a URL instead (`spread/to_storage.py`, from the
spread jobs' plans) and come here for what those leave to one process; spread over processes,
each rank uploads its own files (`spread/bucket.py`). What does not take URLs says so in one
line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.files import source_path
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest, Keys, Progress, ReshardRequest
from ..core.summary import Summary
from ..dcp.format import DcpFormat
from ..format.format import ShardedFormat
from ..storage.location import is_url, open_storage, parse_url
from ..storage.stored_path import stored_root

if TYPE_CHECKING:
    from ..storage.face import Storage
    from .diff import DiffRequest


def source_at(location: str | os.PathLike[str]) -> Path:
    """The path the readers of every format take for `location`: a local path as it is; an
    object-store URL's objects listed once and read in place through the face (a `StoredPath`:
    ranged reads of headers and metadata, tensor bytes streamed in offset order), never copied."""
    if not is_url(location):
        return Path(location)
    return source_path(stored_root(*_listed(str(location))))


def verify_at(location: str | os.PathLike[str], progress: Progress | None = None) -> VerifyReport:
    """`verify`: every check the checkpoint's format allows, local or in an object store
    (fsdpkit's format and DCP by their stored readers, FILES_IN_FLIGHT objects at once)."""
    from .formats import detect_format

    stored = _listed(str(location)) if is_url(location) else None
    path = source_path(stored_root(*stored)) if stored is not None else Path(location)
    found = detect_format(path)
    if stored is not None and found.name == DcpFormat.name:
        from ..dcp.stored import verify_stored_dcp

        return verify_stored_dcp(*stored)
    if stored is not None and found.name == ShardedFormat.name:
        from ..format.stored import verify_stored

        return verify_stored(*stored, progress)
    return found.verify(path, progress)


def inspect_at(location: str | os.PathLike[str], keys: Keys) -> tuple[str, Summary]:
    """`inspect`: (the format's name, the summary) of the checkpoint at `location`."""
    from .formats import detect_format

    stored = _listed(str(location)) if is_url(location) else None
    path = source_path(stored_root(*stored)) if stored is not None else Path(location)
    found = detect_format(path)
    if stored is not None and found.name == DcpFormat.name:
        from ..dcp.stored import summarize_stored_dcp

        return found.name, summarize_stored_dcp(*stored, model_key=keys.model, optimizer_key=keys.optimizer)
    if stored is not None and found.name == ShardedFormat.name:
        from ..format.stored import summarize_stored

        return found.name, summarize_stored(*stored)
    return found.name, found.inspect(path, keys)


def convert_at(src: str, dst: str, request: ConvertRequest, progress: Progress | None = None) -> WriteReport:
    """`convert` from a local directory or an object-store URL (read in place) to either."""
    from .formats import convert_any

    source = source_at(src)
    if not is_url(dst):
        return convert_any(source, dst, request, progress)
    return _published(dst, request.overwrite, lambda out: convert_any(source, out, request, progress))


def reshard_at(src: str, dst: str, request: ReshardRequest) -> WriteReport:
    """`reshard` from a local directory or an object-store URL (read in place) to either."""
    from .formats import reshard_any

    source = source_at(src)
    if not is_url(dst):
        return reshard_any(source, dst, request)
    return _published(dst, request.overwrite, lambda out: reshard_any(source, out, request))


def diff_at(a: str, request: DiffRequest, progress: Callable[[int, int], None] | None = None) -> dict:
    """`diff` of two checkpoints, each a local directory or an object-store URL (`open_checkpoint`
    reads a URL in place)."""
    from .diff import diff

    return diff(a, request, progress)


def _published(url: str, overwrite: bool, write: Callable[[Path], WriteReport]) -> WriteReport:
    """What `write` wrote into a local temporary directory, published at `url` through the face,
    under the writer's lease from before the write: no other command writes `url` meanwhile."""
    from ..storage.upload import claim_destination, publish

    storage = open_storage(url)
    lease, existing = claim_destination(storage, overwrite=overwrite)
    try:
        with tempfile.TemporaryDirectory(prefix="fsdpkit-out-") as staging:
            out = Path(staging) / "out"
            report = write(out)
            publish(out, storage, existing, lease)
    except BaseException:
        with contextlib.suppress(Exception):  # the first failure is the one to report
            lease.release(interrupted=bool(existing))  # as `publishing` does; nothing once it has
        raise
    return dataclasses.replace(report, dst=url, files=[name.replace(str(out), url) for name in report.files])


def local_only(*locations: str | os.PathLike[str] | None, what: str) -> None:
    """A UsageError naming the first URL among `locations`: `what` does not take one yet."""
    for location in locations:
        if location is not None and is_url(location):
            raise UsageError(
                f"{location}: {what} does not take object-storage URLs yet (inspect, verify, convert, reshard and diff do); "
                "use a local directory"
            )


def check_urls(*locations: str | os.PathLike[str] | None) -> None:
    """A UsageError in one line for the first URL among `locations` that fsdpkit cannot use (its
    scheme, bucket or prefix), before anything starts."""
    for location in locations:
        if location is not None and is_url(location):
            parse_url(str(location))


def _listed(url: str) -> tuple[Storage, dict[str, int]]:
    storage = open_storage(url)
    listed = storage.list()
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix")
    return storage, listed
