"""Atomic checkpoint commit in a run directory: temporary dir -> step-NNNNNNNN -> latest.

    tmp = begin(run_dir, step)          # run_dir/.tmp-step-NNNNNNNN-<random>; every rank writes here
    ... every rank: writer.write_rank_file(tmp, ...); gather records; barrier ...
    final = commit(tmp, run_dir, step, manifest, keep_last=3)   # one process (rank 0)

`commit` checks that every file the manifest lists is in `tmp` with its size (a missing
one usually means the ranks do not share a filesystem), writes manifest.json, fsyncs every
file and the directory, renames `tmp` to `step-NNNNNNNN`, fsyncs the run directory, then
replaces `latest` atomically (write a temporary file, fsync, `os.replace`). Only after that,
`keep_last` removes older complete steps (never the one `latest` names) and stale
`.tmp-step-*` directories. A crash at any point leaves `latest` naming a complete
checkpoint (or, before the first commit, no `latest` and no step directory); readers never
take a `.tmp-*` directory. `abort(tmp)` removes an unfinished one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from ..errors import RunError
from .format import LATEST_NAME, STEP_PREFIX, TMP_PREFIX, step_dir_name
from .manifest import Manifest, save_manifest
from .output import fsync_dir, fsync_tree
from .paths import complete_steps, read_latest


def begin(run_dir: str | Path, step: int) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def abort(tmp_dir: str | Path) -> None:
    shutil.rmtree(tmp_dir, ignore_errors=True)


def commit(tmp_dir: str | Path, run_dir: str | Path, step: int, manifest: Manifest, *, keep_last: int | None = None) -> Path:
    tmp_dir, run_dir = Path(tmp_dir), Path(run_dir)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for entry in manifest.files:
        path = tmp_dir / entry.name
        if not path.is_file():
            raise RunError(f"{path}: missing at commit time; every rank must write to the same save directory "
                           f"(on multiple nodes it must be a filesystem all nodes share)")
        if path.stat().st_size != entry.size:
            raise RunError(f"{path}: {path.stat().st_size} bytes, its writer reported {entry.size}")
    save_manifest(tmp_dir, manifest)
    fsync_tree(tmp_dir)
    final = run_dir / step_dir_name(step)
    if final.exists():  # re-saving a step: first make sure `latest` does not name the directory being replaced
        if read_latest(run_dir) == final.name:
            others = [path for _, path in complete_steps(run_dir) if path != final]
            if others:
                _replace_latest(run_dir, others[-1].name)
            else:
                (run_dir / LATEST_NAME).unlink()
                fsync_dir(run_dir)
        old = run_dir / f"{TMP_PREFIX}old-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp_dir, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp_dir, final)
    fsync_dir(run_dir)
    _replace_latest(run_dir, final.name)
    if keep_last is not None:
        prune(run_dir, keep_last=keep_last)
    return final


def _replace_latest(run_dir: Path, name: str) -> None:
    tmp = run_dir / f"{TMP_PREFIX}{LATEST_NAME}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, run_dir / LATEST_NAME)
    fsync_dir(run_dir)


def prune(run_dir: str | Path, *, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete steps (never the one `latest` names),
    and leftover `.tmp-step-*` / `.tmp-old-*` directories of crashed saves. Returns what was removed."""
    run_dir = Path(run_dir)
    latest = read_latest(run_dir)
    removed = []
    steps = complete_steps(run_dir)
    for _, path in steps[: max(0, len(steps) - keep_last)]:
        if path.name != latest:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for child in run_dir.iterdir():
        if child.is_dir() and child.name.startswith((f"{TMP_PREFIX}{STEP_PREFIX}", f"{TMP_PREFIX}old-")):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed
