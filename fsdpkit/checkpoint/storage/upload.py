"""A checkpoint directory written locally, published to a storage through the face: every
object but the commit object first (UPLOADS_IN_FLIGHT files at once, each a multipart upload
streamed from the file in blocks), then the commit object alone (a manifest, DCP's
`.metadata`, DeepSpeed's `latest`, a full checkpoint's index or its one file). An existing
destination loses its commit object before anything else is written, so no reader takes a mix
of old and new objects for a checkpoint; objects of the old checkpoint the new one does not
replace are removed last. A failed upload aborts its multipart uploads, removes what it
uploaded and commits nothing.

WRITING_MARKER is written before anything else and removed after the commit: a destination that
holds it and no commit object is what an interrupted write (a killed process) left, which no
reader takes for a checkpoint and a rerun replaces without --overwrite."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from ...errors import UsageError
from .face import READ_BLOCK_BYTES, Storage
from .local import LocalStorage
from .stale_uploads import abort_stale_uploads

UPLOADS_IN_FLIGHT = 2  # files uploaded at once, each PARTS_IN_FLIGHT parts of PART_BYTES: 128 MiB held at most
COMMIT_NAMES = (
    "manifest.json",
    ".metadata",
    "latest",
    "model.safetensors.index.json",
    "model.safetensors",
)  # the first of these the output holds is its commit object
WRITING_MARKER = ".fsdpkit-writing"  # present while a publish is under way


def check_destination(storage: Storage, *, overwrite: bool) -> dict[str, int]:
    """The objects already under the destination (name -> size); a UsageError when there are any
    and `overwrite` is not given."""
    existing = storage.list()
    if existing and not overwrite and not interrupted(existing):
        raise UsageError(f"destination {storage.root} already holds {len(existing)} objects; pass --overwrite to replace them")
    return existing


def interrupted(existing: dict[str, int]) -> bool:
    """`existing` is what an interrupted publish left: its marker, and no commit object."""
    return WRITING_MARKER in existing and not any(name in existing for name in COMMIT_NAMES)


def publish(directory: Path, storage: Storage, existing: dict[str, int], progress: Callable[[int], None] | None = None) -> list[str]:
    """Upload the files under `directory` to `storage`, the commit object last; the names written."""
    source = LocalStorage(directory)
    names = sorted(source.list())
    commit = next((name for name in COMMIT_NAMES if name in names), None)
    old_commits = [name for name in COMMIT_NAMES if name in existing]
    started = datetime.now(UTC)
    storage.put(WRITING_MARKER, b"")
    if WRITING_MARKER in existing:  # a write cut short: the uploads it left open go
        abort_stale_uploads(storage, initiated_before=started)
    storage.delete(old_commits)
    data = [name for name in names if name != commit]
    try:
        with ThreadPoolExecutor(UPLOADS_IN_FLIGHT, thread_name_prefix="fsdpkit-upload") as pool:
            for _ in pool.map(lambda name: upload_file(source, storage, name, progress), data):
                pass
        if commit is not None:  # streamed too: a full checkpoint's one file is its commit object
            upload_file(source, storage, commit, progress)
    except BaseException:
        with contextlib.suppress(Exception):  # the first failure is the one to report
            storage.delete(data if existing else [*data, WRITING_MARKER])  # over an old checkpoint, the marker says what is left
        raise
    storage.delete(sorted(set(existing) - set(names) - set(old_commits) - {WRITING_MARKER}))
    storage.delete([WRITING_MARKER])
    return names


def upload_file(source: LocalStorage, storage: Storage, name: str, progress: Callable[[int], None] | None = None) -> None:
    """File `name` of `source` streamed into object `name` of `storage` (a multipart upload)."""
    size = source.size(name) or 0
    with storage.write(name) as stream:
        for _, block in source.read_blocks(name, [(0, size)], block_bytes=READ_BLOCK_BYTES):
            stream.write(block)
            if progress is not None:
                progress(len(block))
