"""Finding a checkpoint on disk, and keeping every path inside it.

`resolve_checkpoint(path)` accepts a step directory (it holds manifest.json) or a run
directory: there it follows `latest`, or, when `latest` is absent (a crash before the very
first `latest` was written), takes the highest complete `step-NNNNNNNN`. In-progress
`.tmp-*` directories are never taken. `checkpoint_file(step_dir, name)` joins a file name
from a manifest and refuses anything that would leave the directory (separators, '..',
symlinks pointing out).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import DataCheckError
from .format import LATEST_NAME, MANIFEST_NAME, is_safe_file_name, parse_step_dir_name


def complete_steps(run_dir: str | Path) -> list[tuple[int, Path]]:
    """The complete step directories of a run, oldest first."""
    run_dir = Path(run_dir)
    steps = []
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            step = parse_step_dir_name(child.name)
            if step is not None and (child / MANIFEST_NAME).is_file():
                steps.append((step, child))
    return sorted(steps)


def read_latest(run_dir: Path) -> str | None:
    """The step directory name that `latest` holds, validated; None when there is no `latest`."""
    latest = run_dir / LATEST_NAME
    if not latest.exists():
        return None
    try:
        raw = latest.read_bytes()[:256]
        name = raw.decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise DataCheckError(f"{latest}: unreadable ({error})") from None
    if parse_step_dir_name(name) is None or not is_safe_file_name(name):
        raise DataCheckError(f"{latest}: holds {name[:40]!r}, expected a step directory name such as step-00000100")
    return name


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory that `path` (a step directory or a run directory) denotes."""
    path = Path(path)
    if not path.exists():
        raise DataCheckError(f"{path}: does not exist")
    if not path.is_dir():
        raise DataCheckError(f"{path}: is not a directory, expected an fsdpkit checkpoint")
    if (path / MANIFEST_NAME).is_file():
        return path
    name = read_latest(path)
    if name is not None:
        target = path / name
        if not (target / MANIFEST_NAME).is_file():
            raise DataCheckError(f"{path / LATEST_NAME}: names {name}, which is missing or has no {MANIFEST_NAME}")
        return target
    steps = complete_steps(path)
    if steps:
        return steps[-1][1]
    raise DataCheckError(f"{path}: not an fsdpkit checkpoint (no {MANIFEST_NAME}, no {LATEST_NAME}, no complete step-* directory)")


def checkpoint_file(step_dir: Path, name: str) -> Path:
    """`step_dir / name`, refusing names or symlinks that lead outside `step_dir`."""
    if not is_safe_file_name(name):
        raise DataCheckError(f"{step_dir}: file name {name!r} is not a plain file name inside the checkpoint")
    path = step_dir / name
    if path.is_symlink():
        root = os.path.realpath(step_dir)
        if os.path.dirname(os.path.realpath(path)) != root:
            raise DataCheckError(f"{path}: symlink points outside the checkpoint directory")
    return path
