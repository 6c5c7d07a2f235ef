"""A run directory in an object store (`train --save-dir s3://bucket/prefix`), through the storage
face. There is no rename, so a save writes its step's objects under their final names and the
step becomes a checkpoint only when its commit object appears:

1. `begin`: the multipart uploads a killed run left open are aborted; a step saved again
   first loses its manifest (and `latest`, if it named it), then
   its other objects;
2. each rank streams its rank file (`write_rank_file`): crc32s computed from the bytes in memory
   first, so the header is whole before the first byte goes up (a multipart upload, aborted on
   an error);
3. `commit` (rank 0, once every rank wrote): `step-N/manifest.json`, then `latest`, then
   keep-last-k (each old step loses its manifest first) and the removal of the objects of steps
   a save cut short.

A step without `manifest.json` is no checkpoint to any reader (`stored.resolve_stored`,
`--resume`), whatever else lies under it. The one-writer lock is `.lock`, made with a
conditional create (`If-None-Match: *`; docs/object-storage.md says what holds on a store
without one)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from ...errors import DataCheckError, RunError, UsageError
from ..core.crc import crc32
from ..core.files import source_path
from ..core.names import STEP_PREFIX
from ..storage.face import Storage
from ..storage.location import is_url, open_storage
from ..storage.stale_uploads import abort_stale_uploads
from ..storage.stored_path import stored_root
from .manifest import Manifest
from .names import LATEST_NAME, MANIFEST_NAME, parse_step_dir_name, rank_file_name, step_dir_name
from .placement import FileLayout
from .stored import is_stored_sharded, resolve_stored, summarize_stored

CRC_CHUNK_BYTES = 32 << 20  # one crc32 update without the GIL


def listed_run(storage: Storage) -> dict[str, int]:
    """Every object of the run (name -> size); a missing bucket or a bad credential is the store's UsageError."""
    return storage.list()


def complete_steps(listed: dict[str, int]) -> list[tuple[int, str]]:
    """(step, step directory name) of every step that holds a manifest, oldest first."""
    steps = set()
    for name in listed:
        first, _, rest = name.partition("/")
        step = parse_step_dir_name(first)
        if step is not None and rest == MANIFEST_NAME:
            steps.add((step, first))
    return sorted(steps)


def _latest(storage: Storage, listed: dict[str, int]) -> str | None:
    if LATEST_NAME not in listed:
        return None
    return storage.read(LATEST_NAME, 0, min(listed[LATEST_NAME], 256)).decode("ascii", "replace").strip()


def _objects_of(listed: dict[str, int], step_name: str) -> list[str]:
    return sorted(name for name in listed if name.startswith(f"{step_name}/"))


def _remove_step(storage: Storage, listed: dict[str, int], step_name: str) -> None:
    """The step's manifest first (so it stops being a checkpoint), then the rest."""
    storage.delete([f"{step_name}/{MANIFEST_NAME}"])
    storage.delete([name for name in _objects_of(listed, step_name) if name != f"{step_name}/{MANIFEST_NAME}"])


def begin(storage: Storage, step: int, *, writer_started: datetime) -> None:
    """Make room for step `step`: the multipart uploads a killed writer left open are aborted
    (those initiated before `writer_started`, when this writer began), and what an earlier save
    of the step left goes, `latest` first moved off it."""
    abort_stale_uploads(storage, initiated_before=writer_started)
    listed = listed_run(storage)
    name = step_dir_name(step)
    if not _objects_of(listed, name):
        return
    if _latest(storage, listed) == name:
        others = [other for _, other in complete_steps(listed) if other != name]
        if others:
            storage.commit(LATEST_NAME, (others[-1] + "\n").encode())
        else:
            storage.delete([LATEST_NAME])
    _remove_step(storage, listed, name)


def write_rank_file(storage: Storage, name: str, layout: FileLayout, payloads: Sequence[memoryview]) -> int:
    """Object `name`: the rank file of `layout` holding `payloads` (each fragment's bytes, in data
    order), streamed. Returns the data bytes written."""
    crcs = []
    for payload in payloads:
        crc = 0
        for offset in range(0, payload.nbytes, CRC_CHUNK_BYTES):
            crc = crc32(payload[offset : offset + CRC_CHUNK_BYTES], crc)
        crcs.append(crc)
    with storage.write(name) as stream:
        for part in layout.header_with(crcs):
            stream.write(part)
        for payload in payloads:
            for offset in range(0, payload.nbytes, CRC_CHUNK_BYTES):
                stream.write(payload[offset : offset + CRC_CHUNK_BYTES])
    return sum(payload.nbytes for payload in payloads)


def commit(storage: Storage, step: int, manifest: Manifest, *, keep_last: int | None) -> str:
    """Step `step` whole: every rank file checked present at its size, its manifest, `latest`,
    then keep-last-k. Returns the step's URL."""
    name = step_dir_name(step)
    listed = listed_run(storage)
    layout = manifest.layout()
    for rank in range(manifest.shard_factor):
        file = f"{name}/{rank_file_name(rank, manifest.shard_factor)}"
        expected = layout.file_layout(rank).size
        if listed.get(file) != expected:
            raise RunError(
                f"{storage.where(file)}: {'missing' if file not in listed else f'{listed[file]} bytes, not {expected}'} at commit time"
            )
    storage.commit(f"{name}/{MANIFEST_NAME}", manifest.to_bytes())
    storage.commit(LATEST_NAME, (name + "\n").encode())
    if keep_last is not None and manifest.run_id is not None:
        prune(storage, keep_last=keep_last, run_id=manifest.run_id)
    else:
        remove_unfinished(storage)
    return storage.where(name)


def _run_of(storage: Storage, step_name: str) -> str | None:
    with contextlib.suppress(DataCheckError, RunError, ValueError):
        return Manifest.from_json(json.loads(storage.read(f"{step_name}/{MANIFEST_NAME}")), where=step_name).run_id
    return None


def steps_of_run(storage: Storage, listed: dict[str, int], run_id: str) -> list[str]:
    return [name for _, name in complete_steps(listed) if _run_of(storage, name) == run_id]


def prune(storage: Storage, *, keep_last: int, run_id: str) -> list[str]:
    """Remove the steps of run `run_id` but its newest `keep_last` (never the one `latest` names),
    and the unfinished steps; the step names removed."""
    listed = listed_run(storage)
    latest = _latest(storage, listed)
    mine = steps_of_run(storage, listed, run_id)
    removed = [name for name in mine[: max(0, len(mine) - keep_last)] if name != latest]
    for name in removed:
        _remove_step(storage, listed, name)
    return removed + remove_unfinished(storage)


def remove_unfinished(storage: Storage) -> list[str]:
    """Remove the objects of every step that has no manifest (a save cut short): no reader takes
    them for a checkpoint, and the lock makes this run the only writer. Returns the step names."""
    listed = listed_run(storage)
    whole = {name for _, name in complete_steps(listed)}
    cut = sorted({name.partition("/")[0] for name in listed if name.startswith(STEP_PREFIX) and "/" in name} - whole)
    for name in cut:
        storage.delete(_objects_of(listed, name))
    return cut


def newest_of_run(url: str, *, run_id: str) -> str | None:
    """The URL of the newest complete step that run `run_id` saved under `url`, or None."""
    storage = open_storage(url)
    mine = steps_of_run(storage, listed_run(storage), run_id)
    return storage.where(mine[-1]) if mine else None


def resolve_url(url: str) -> tuple[str, Manifest]:
    """(the URL of the step that `url` denotes, its manifest): a step, or a run's `latest`."""
    storage = open_storage(url)
    listed = listed_run(storage)
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix (no checkpoint there)")
    step, manifest = resolve_stored(storage, listed)
    return (storage.where(step) if step else storage.root), manifest


def checked_stored(url: str) -> tuple[str, Manifest] | None:
    """(the URL of the step, its manifest) of the fsdpkit checkpoint at `url`, every rank file's
    header checked against it in the bucket (ranged reads); None for another kind of checkpoint."""
    storage = open_storage(url)
    listed = listed_run(storage)
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix (no checkpoint there)")
    if not is_stored_sharded(listed):
        return None
    summarize_stored(storage, listed)
    step, manifest = resolve_stored(storage, listed)
    return (storage.where(step) if step else storage.root), manifest


def stored_checkpoint(url: str) -> Path:
    """The checkpoint at `url` (a run's `latest` step, a step, or any other checkpoint's objects)
    as a path the readers read in place (a `StoredPath`): the objects are listed once and each
    reader's bytes come straight from the bucket through the face's streamed GETs (bounded
    memory, nothing copied to disk); messages name the URL."""
    storage = open_storage(url)
    listed = listed_run(storage)
    if not listed:
        raise UsageError(f"{url}: no objects under this prefix (no checkpoint there)")
    step = resolve_stored(storage, listed)[0] if is_stored_sharded(listed) else ""
    root = source_path(stored_root(storage, listed))
    return root / step if step else root


def same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def continues(save_dir: str, resume: str | os.PathLike[str] | None) -> bool:
    """Does `resume` name the run at URL `save_dir`, or one of its steps?"""
    if not resume or not is_url(resume):
        return False
    resume = str(resume).rstrip("/")
    return same_url(save_dir, resume) or same_url(save_dir, resume.rpartition("/")[0])


def writers(url: str) -> list[tuple[str, str | None]]:
    """(step name, run id) of every complete step under `url`, oldest first."""
    storage = open_storage(url)
    return [(name, _run_of(storage, name)) for _, name in complete_steps(listed_run(storage))]


def check_reachable(url: str) -> None:
    """The bucket is there and the credentials list it (a UsageError naming what is wrong)."""
    listed_run(open_storage(url))
