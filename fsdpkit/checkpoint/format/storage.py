"""fsdpkit's run directories on disk (no torch): finding their checkpoints, making them appear
atomically (the save protocol is docs/checkpoint-format.md's "Directory layout": a
crash at any point leaves `latest` naming a complete checkpoint), pruning only the run's own
checkpoints (the manifest's run id, see lock.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from pathlib import Path

from ...errors import DataCheckError, RunError, UsageError
from ..core.files import read_regular, replace_file, source_path
from ..core.names import STEP_PREFIX, TMP_PREFIX, is_safe_file_name
from ..core.staging import fsync_dir
from .manifest import Manifest, load_manifest, save_manifest
from .names import LATEST_NAME, MANIFEST_NAME, parse_step_dir_name, rank_file_name, step_dir_name


def complete_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete step directories of a run, oldest first."""
    run_dir = source_path(run_dir)
    children = run_dir.iterdir() if run_dir.is_dir() else ()
    named = ((parse_step_dir_name(child.name), child) for child in children)
    return sorted((step, child) for step, child in named if step is not None and (child / MANIFEST_NAME).is_file())


def read_latest(run_dir: Path) -> str | None:
    """The step directory name that `latest` holds, validated; None when there is no `latest`."""
    latest = run_dir / LATEST_NAME
    if not latest.exists():
        return None
    try:
        name = read_regular(latest, 256).decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise DataCheckError(f"{latest}: unreadable ({error})") from None
    if parse_step_dir_name(name) is None or not is_safe_file_name(name):
        raise DataCheckError(f"{latest}: holds {name[:40]!r}, expected a step directory name such as step-00000100")
    return name


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The step directory that `path` (a step directory or a run directory) denotes."""
    path = source_path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    if not path.is_dir():
        raise DataCheckError(f"{path}: is not a directory, expected an fsdpkit checkpoint")
    if (path / MANIFEST_NAME).is_file():
        return path
    name = read_latest(path)
    if name is not None:
        if not (path / name / MANIFEST_NAME).is_file():
            raise DataCheckError(f"{path / LATEST_NAME}: names {name}, which is missing or has no {MANIFEST_NAME}")
        return path / name
    steps = complete_steps(path)
    if steps:
        return steps[-1][1]
    raise DataCheckError(f"{path}: not an fsdpkit checkpoint (no {MANIFEST_NAME}, no {LATEST_NAME}, no complete step-* directory)")


def _run_tag(run_id: str | None) -> str:
    """8 hex digits naming a run in temporary directory names."""
    return hashlib.blake2b((run_id or "").encode(), digest_size=4).hexdigest()


def begin(run_dir: str | Path, step: int, *, run_id: str | None = None) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"{TMP_PREFIX}{step_dir_name(step)}-{_run_tag(run_id)}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def abort(tmp_dir: str | Path) -> None:
    shutil.rmtree(tmp_dir, ignore_errors=True)


def commit(tmp_dir: str | Path, run_dir: str | Path, step: int, manifest: Manifest, *, keep_last: int | None = None) -> Path:
    """Make the save in `tmp_dir` step `step` of `run_dir`, then prune (`keep_last`). Every rank
    file must be in `tmp_dir` already, written and fsynced by its rank."""
    tmp_dir, run_dir = Path(tmp_dir), Path(run_dir)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    present = {entry.name for entry in tmp_dir.iterdir()}
    for rank in range(manifest.shard_factor):
        name = rank_file_name(rank, manifest.shard_factor)
        if name not in present:
            raise RunError(
                f"{tmp_dir / name}: missing at commit time; every rank must write to the same save directory "
                f"(on multiple nodes it must be a filesystem all nodes share)"
            )
    save_manifest(tmp_dir, manifest)
    fsync_dir(tmp_dir)
    final = run_dir / step_dir_name(step)
    if final.exists():  # re-saving a step: first make sure `latest` does not name the directory being replaced
        if read_latest(run_dir) == final.name:
            others = [path for _, path in complete_steps(run_dir) if path != final]
            if others:
                _replace_latest(run_dir, others[-1].name)
            else:
                (run_dir / LATEST_NAME).unlink()
                fsync_dir(run_dir)
        old = run_dir / f"{TMP_PREFIX}old-{final.name}-{_run_tag(manifest.run_id)}-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp_dir, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp_dir, final)
    fsync_dir(run_dir)
    _replace_latest(run_dir, final.name)
    if keep_last is not None and manifest.run_id is not None:
        prune(run_dir, keep_last=keep_last, run_id=manifest.run_id)
    return final


def _replace_latest(run_dir: Path, name: str) -> None:
    replace_file(run_dir / LATEST_NAME, (name + "\n").encode(), run_dir / f"{TMP_PREFIX}{LATEST_NAME}-{uuid.uuid4().hex[:8]}")
    fsync_dir(run_dir)


def prune(run_dir: str | Path, *, keep_last: int, run_id: str) -> list[Path]:
    """Remove the complete steps of run `run_id` but its newest `keep_last` (never the one
    `latest` names), and that run's leftover temporary directories; what was removed. A
    directory another run wrote (another id, or none: older checkpoints) is never touched."""
    run_dir = Path(run_dir)
    latest = read_latest(run_dir)
    mine = _steps_of_run(run_dir, run_id)
    removed = [path for path in mine[: max(0, len(mine) - keep_last)] if path.name != latest]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed + remove_unfinished(run_dir, run_id=run_id)


def remove_unfinished(run_dir: str | Path, *, run_id: str) -> list[Path]:
    """Remove the temporary directories that saves of run `run_id` left behind (a crash, a
    killed worker); another run's are never touched. Call it only while no save of that run
    is in flight. Returns what was removed."""
    tag, prefixes = f"-{_run_tag(run_id)}-", (f"{TMP_PREFIX}{STEP_PREFIX}", f"{TMP_PREFIX}old-")
    children = Path(run_dir).iterdir() if Path(run_dir).is_dir() else ()  # no directory: nothing saved yet
    removed = [child for child in children if child.is_dir() and child.name.startswith(prefixes) and tag in child.name]
    for child in removed:
        shutil.rmtree(child, ignore_errors=True)
    return removed


def newest_of_run(run_dir: str | Path, *, run_id: str) -> Path | None:
    """The newest complete checkpoint in `run_dir` that run `run_id` wrote, or None."""
    mine = _steps_of_run(run_dir, run_id)
    return mine[-1] if mine else None


def _steps_of_run(run_dir: str | Path, run_id: str) -> list[Path]:
    """The complete steps that run `run_id` wrote, oldest first (an unreadable one is not provably its)."""
    mine = []
    for _, path in complete_steps(run_dir):
        with contextlib.suppress(DataCheckError):
            if load_manifest(path).run_id == run_id:
                mine.append(path)
    return mine
