"""Output published to a storage through the face: `publishing` is the frame of every such
write, whose objects its block writes (streamed by `spread/to_storage.py`), and `publish` a
checkpoint directory written locally, uploaded in it: every
object but the commit object first (UPLOADS_IN_FLIGHT files at once, each a multipart upload
streamed from the file in blocks), then the commit object alone (a manifest, DCP's
`.metadata`, DeepSpeed's `latest`, a full checkpoint's index or its one file). An existing
destination loses its commit object before anything else is written, so no reader takes a mix
of old and new objects for a checkpoint; objects of the old checkpoint the new one does not
replace are removed last. A failed upload aborts its multipart uploads, removes what it
uploaded and commits nothing.

WRITING_MARKER, the writer's lease (`storage.lease`: one writer at a time), is made before
anything else and removed after the commit: a destination that holds it and no commit object is
what an interrupted write (a killed process) left, which no reader takes for a checkpoint and a
rerun replaces without --overwrite."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from ...errors import UsageError
from ...sizes import count
from .face import READ_BLOCK_BYTES, Storage, WriteStream
from .lease import WRITING_MARKER, WriterLease, refuse_if_held
from .local import LocalStorage

UPLOADS_IN_FLIGHT = 2  # files uploaded at once, each PARTS_IN_FLIGHT parts of PART_BYTES: 128 MiB held at most
COMMIT_NAMES = (
    "manifest.json",
    ".metadata",
    "latest",
    "model.safetensors.index.json",
    "model.safetensors",
)  # the first of these the output holds is its commit object


def check_destination(storage: Storage, *, overwrite: bool) -> dict[str, int]:
    """The objects already under the destination (name -> size), writing nothing; a UsageError
    when another writer holds the destination's lease, or when objects are there and `overwrite`
    is not given."""
    existing = storage.list()
    if WRITING_MARKER in existing:
        refuse_if_held(storage)
    _refuse_objects(storage, existing, overwrite=overwrite)
    return existing


def claim_destination(
    storage: Storage, *, overwrite: bool, check: Callable[[dict[str, int]], None] | None = None
) -> tuple[WriterLease, dict[str, int]]:
    """The writer's lease on the destination, then the objects already there (the marker among
    them only where one was there before); refused as `check_destination` refuses, or as `check`
    of those objects does, with the destination left as it was found."""
    lease = WriterLease.take(storage)
    try:
        existing = storage.list()
        if not lease.found_marker:
            existing.pop(WRITING_MARKER, None)
        _refuse_objects(storage, existing, overwrite=overwrite)
        if check is not None:
            check(existing)
    except BaseException:
        with contextlib.suppress(Exception):  # the refusal is the one to report
            lease.release(interrupted=lease.found_marker)
        raise
    return lease, existing


def _refuse_objects(storage: Storage, existing: dict[str, int], *, overwrite: bool) -> None:
    if existing and not overwrite and not interrupted(existing):
        raise UsageError(f"destination {storage.root} already holds {count(len(existing), 'object')}; pass --overwrite to replace them")


def interrupted(existing: dict[str, int]) -> bool:
    """`existing` is what an interrupted publish left: its marker, and no commit object."""
    return WRITING_MARKER in existing and not any(name in existing for name in COMMIT_NAMES)


def commit_object(names: Iterable[str]) -> str | None:
    """The commit object among `names`: the first of COMMIT_NAMES they hold."""
    held = set(names)
    return next((name for name in COMMIT_NAMES if name in held), None)


@contextlib.contextmanager
def publishing(storage: Storage, existing: dict[str, int], lease: WriterLease) -> Iterator[list[str]]:
    """The frame of a write to `storage` over `existing` objects under the writer's `lease`
    (`claim_destination`): the old commit objects deleted; the block writes its objects (the
    commit object last) and appends each name to the list it is given before the object's write
    begins (an interrupt that lands as an upload completes finds its name there). A block that
    fails removes what it wrote; one that ends removes the old checkpoint's objects it did not
    replace, then the lease's marker."""
    old_commits = [name for name in COMMIT_NAMES if name in existing]
    started = datetime.now(UTC)
    written: list[str] = []
    try:
        if WRITING_MARKER in existing:  # a write cut short: the uploads it left open go
            from .stale_uploads import abort_stale_uploads  # its S3 client only when there is one to sweep

            abort_stale_uploads(storage, initiated_before=started)
        storage.delete(old_commits)
        yield written
    except BaseException:
        with contextlib.suppress(Exception):  # the first failure is the one to report
            storage.delete(written)
        with contextlib.suppress(Exception):
            lease.release(interrupted=bool(existing))  # over an old checkpoint, the marker says what is left
        raise
    storage.delete(sorted(set(existing) - set(written) - set(old_commits) - {WRITING_MARKER}))
    lease.release(interrupted=False)


def publish(
    directory: Path, storage: Storage, existing: dict[str, int], lease: WriterLease, progress: Callable[[int], None] | None = None
) -> list[str]:
    """Upload the files under `directory` to `storage` under the writer's `lease`, the commit
    object last; the names written."""
    source = LocalStorage(directory)
    names = sorted(source.list())
    commit = commit_object(names)
    data = [name for name in names if name != commit]
    with publishing(storage, existing, lease) as written:
        written += data  # removed again on a failure, as the ones uploaded are
        with ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="fsdpkit-upload") as pool:
            for _ in pool.map(lambda name: upload_file(source, storage, name, progress), data):
                pass
        if commit is not None:  # streamed too: a full checkpoint's one file is its commit object
            lease.check()
            written.append(commit)
            upload_file(source, storage, commit, progress)
    return names


def upload_file(source: LocalStorage, storage: Storage, name: str, progress: Callable[[int], None] | None = None) -> None:
    """Object `name` of `source` streamed into `storage` (one multipart upload)."""
    with storage.write(name) as stream:
        copy_into(source, name, stream, progress)


def copy_into(source: LocalStorage, name: str, stream: WriteStream, progress: Callable[[int], None] | None = None) -> None:
    """The bytes of object `name` of `source` written to `stream`, in blocks."""
    size = source.size(name) or 0
    for _, block in source.read_blocks(name, [(0, size)], block_bytes=READ_BLOCK_BYTES):
        stream.write(block)
        if progress is not None:
            progress(len(block))
