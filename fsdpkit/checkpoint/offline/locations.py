"""The offline commands at a location: a local path goes to the registry of formats; an
object-store URL (`s3://`, `gs://`, `az://`) is read through the storage face. `verify` and
`inspect` stream fsdpkit's format (version 2) and DCP from the store; the other formats, and
the sources of `convert`, `reshard` and `diff`, are copied through the face into a local
temporary directory first (TMPDIR). `convert` and `reshard` write to a URL by writing the output
into a local temporary directory, then publishing it through the face, the commit object last.
`open_checkpoint` of a URL opens such a copy, removed when the checkpoint is closed. What does
not take URLs yet (train's checkpoint flags) says so in one line."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.any_checkpoint import AnyCheckpoint
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest, Keys, Progress, ReshardRequest
from ..core.summary import Summary
from ..dcp.stored import is_stored_dcp, summarize_stored_dcp, verify_stored_dcp
from ..format.stored import is_stored_sharded, resolve_stored, summarize_stored, verify_stored
from ..storage.download import download
from ..storage.face import Storage
from ..storage.location import is_url, open_storage
from ..storage.upload import check_destination, publish

if TYPE_CHECKING:
    from .diff import DiffRequest


def verify_at(location: str | os.PathLike[str], progress: Progress | None = None) -> VerifyReport:
    """`verify`: every check the checkpoint's format allows, local or in an object store
    (fsdpkit's format and DCP streamed, the others from a local copy)."""
    from .formats import detect_format

    if is_url(location):
        storage, listed = _listed(str(location))
        if is_stored_dcp(listed):
            return verify_stored_dcp(storage, listed)
        if is_stored_sharded(listed):
            return verify_stored(storage, listed, progress)
    with local_source(location) as (path, renamed):
        report = detect_format(path).verify(Path(path), progress)
        return dataclasses.replace(report, path=renamed(report.path), problems=[renamed(line) for line in report.problems])


def inspect_at(location: str | os.PathLike[str], keys: Keys) -> tuple[str, Summary]:
    """`inspect`: (the format's name, the summary) of the checkpoint at `location`."""
    from .formats import detect_format

    if is_url(location):
        storage, listed = _listed(str(location))
        if is_stored_dcp(listed):
            return "dcp", summarize_stored_dcp(storage, listed, model_key=keys.model, optimizer_key=keys.optimizer)
        if is_stored_sharded(listed):
            return "sharded", summarize_stored(storage, listed)
    with local_source(location) as (path, renamed):
        found = detect_format(path)
        summary = found.inspect(Path(path), keys)
        return found.name, dataclasses.replace(summary, path=renamed(summary.path))


def convert_at(src: str, dst: str, request: ConvertRequest, progress: Progress | None = None) -> WriteReport:
    """`convert` from a local directory or an object-store URL to either."""
    from .formats import convert_any

    with local_source(src) as (path, renamed):
        if not is_url(dst):
            report = convert_any(path, dst, request, progress)
        else:
            report = _published(dst, request.overwrite, lambda out: convert_any(path, out, request, progress))
        return dataclasses.replace(report, src=renamed(report.src))


def reshard_at(src: str, dst: str, request: ReshardRequest) -> WriteReport:
    """`reshard` from a local directory or an object-store URL to either."""
    from .formats import reshard_any

    with local_source(src) as (path, renamed):
        if not is_url(dst):
            report = reshard_any(path, dst, request)
        else:
            report = _published(dst, request.overwrite, lambda out: reshard_any(path, out, request))
        return dataclasses.replace(report, src=renamed(report.src))


def diff_at(a: str, request: DiffRequest, progress: Callable[[int, int], None] | None = None) -> dict:
    """`diff` of two checkpoints, each a local directory or an object-store URL."""
    from .diff import diff

    with local_source(a) as (path_a, renamed_a), local_source(request.b) as (path_b, renamed_b):
        result = diff(path_a, dataclasses.replace(request, b=path_b), progress)
    result["a"]["path"], result["b"]["path"] = renamed_a(result["a"]["path"]), renamed_b(result["b"]["path"])
    return result


def open_at(location: str, *, model_key: str | None, optimizer_key: str | None) -> AnyCheckpoint:
    """`open_checkpoint` of a URL: its objects copied through the face into a temporary
    directory, which closing the checkpoint removes."""
    from .formats import open_checkpoint

    staging = contextlib.ExitStack()
    path, _ = staging.enter_context(local_source(location))
    try:
        opened = open_checkpoint(path, model_key=model_key, optimizer_key=optimizer_key)
    except BaseException:
        staging.close()
        raise
    close = opened._close

    def close_and_remove() -> None:
        try:
            close()
        finally:
            staging.close()

    opened._close, opened.opened_from = close_and_remove, location
    return opened


@contextlib.contextmanager
def local_source(location: str | os.PathLike[str]) -> Iterator[tuple[str, Callable[[str], str]]]:
    """(a local path holding the checkpoint at `location`, a function that names the location
    again in the messages and reports of that path): a local path itself; a URL's objects
    downloaded through the face into a temporary directory (TMPDIR; of an fsdpkit run, the
    step its `latest` names only), removed after."""
    if not is_url(location):
        yield str(location), lambda text: text
        return
    storage, listed = _listed(str(location))
    step = resolve_stored(storage, listed)[0] if not is_stored_dcp(listed) and is_stored_sharded(listed) else ""
    prefix = f"{step}/" if step else ""
    wanted = {name: size for name, size in listed.items() if name.startswith(prefix) and "/" not in name[len(prefix) :]} if step else listed
    with tempfile.TemporaryDirectory(prefix="fsdpkit-src-") as staging:
        download(storage, wanted, Path(staging))
        path = str(Path(staging) / step) if step else staging
        url = storage.where(step) if step else storage.root
        yield path, lambda text: text.replace(path, url)


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
                f"{location}: {what} does not take object-storage URLs yet (inspect, verify, convert, reshard and diff do); "
                "use a local directory"
            )


def _listed(url: str) -> tuple[Storage, dict[str, int]]:
    storage = open_storage(url)
    listed = storage.list()
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix")
    return storage, listed
