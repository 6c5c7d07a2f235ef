"""A save directory belongs to one run.

A run that does not continue the checkpoints in its --save-dir (no --resume, or a --resume from
elsewhere) is refused before launch when the directory already holds checkpoints of another
run: the error names them and the run that wrote them, and offers `--resume DIR` (continue
that run) or `--new-run` (start a new one there).

A run that goes on from the newest checkpoint of its --save-dir (--resume DIR, or that step)
keeps that checkpoint's run id: one run, however often it is resumed, is one run in these
messages and to --keep-last. A resume from an earlier step branches off: a new run id.

With --new-run, the earlier checkpoints are set aside before the first save, all together, with
the `latest` that names them: `DIR/earlier-YYYYMMDD-HHMMSS/` is then a run directory of its own
(`--resume DIR/earlier-...` continues it). So `DIR/latest` only ever names a checkpoint of the
run now saving there: never a lower step of another run, and no step directory is overwritten.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ..core.staging import fsync_dir
from ..storage.location import is_url
from . import run_store
from .manifest import load_manifest
from .names import LATEST_NAME
from .storage import complete_steps, resolve_checkpoint

EARLIER_PREFIX = "earlier-"


def _writer(step_dir: Path) -> tuple[str | None, str | None]:
    """(run id, model name) of the run that wrote a checkpoint; (None, None) when unreadable."""
    try:
        manifest = load_manifest(step_dir)
    except DataCheckError:
        return None, None
    config = (manifest.training_state or {}).get("config") or {}
    return manifest.run_id, (config.get("model") or {}).get("name") if isinstance(config, dict) else None


def continues(save_dir: str | Path, resume: str | Path | None) -> bool:
    """Does a --resume from `resume` continue the checkpoints of `save_dir` (it is that run
    directory, or one of its step directories)?"""
    if not resume:
        return False
    if is_url(save_dir):
        return run_store.continues(str(save_dir), resume)
    save, source = os.path.realpath(save_dir), os.path.realpath(resume)
    return source == save or os.path.dirname(source) == save


def continued_run_id(save_dir: str | Path, resume: str | Path | None) -> str | None:
    """The run id a run resuming from `resume` into `save_dir` goes on with: that of the
    checkpoint it resumes, when that is the newest in `save_dir`; None (a new id) otherwise."""
    if resume is None or not continues(save_dir, resume):
        return None
    if is_url(save_dir):
        newest = run_store.writers(str(save_dir))[-1:]
        resumed_url, resumed_manifest = run_store.resolve_url(str(resume))
        return resumed_manifest.run_id if newest and run_store.same_url(resumed_url, f"{save_dir}/{newest[0][0]}") else None
    steps = complete_steps(save_dir)
    resumed = resolve_checkpoint(resume)
    if not steps or os.path.realpath(steps[-1][1]) != os.path.realpath(resumed):
        return None
    return _writer(resumed)[0]


def check_save_dir(save_dir: str | Path, *, resume: str | Path | None, new_run: bool, run_id: str | None = None) -> None:
    """UsageError when `save_dir` holds checkpoints this run would mix with its own; a run's own
    checkpoints (`run_id`, e.g. a worker that torchrun restarted) do not count."""
    if new_run or continues(save_dir, resume):
        return
    found: list[tuple[Path, str | None, str | None]]
    if is_url(save_dir):
        found = [(Path(name), writer, None) for name, writer in run_store.writers(str(save_dir))]
        then = "or give the new run a prefix of its own (an object store cannot set them aside for --new-run)"
    else:
        found = [(path, *_writer(path)) for _, path in complete_steps(save_dir)]
        then = (
            "or start a new run there with --new-run "
            f"(its checkpoints are then moved to {Path(save_dir) / (EARLIER_PREFIX + 'YYYYMMDD-HHMMSS')})"
        )
    others = [(path, writer, model) for path, writer, model in found if writer is None or writer != run_id]
    if not others:
        return
    names = ", ".join(path.name for path, _, _ in others[-3:]) + (f" (and {len(others) - 3} earlier)" if len(others) > 3 else "")
    runs = sorted({f"run {writer or 'unknown'}" + (f", model {model}" if model else "") for _, writer, model in others})
    raise UsageError(
        f"--save-dir {save_dir} already holds checkpoints {names} of another run ({'; '.join(runs)}): "
        f"continue that run with --resume {save_dir}, {then}"
    )


def set_aside(save_dir: str | Path) -> Path | None:
    """Move every complete checkpoint of `save_dir`, and its `latest`, into a new
    `earlier-<UTC time>` run directory inside it; returns that directory (None: nothing to move).
    `latest` goes first, so that `save_dir/latest` never names a directory that was moved."""
    save_dir = Path(save_dir)
    steps = complete_steps(save_dir)
    if not steps:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = save_dir / f"{EARLIER_PREFIX}{stamp}"
    suffix = 1
    while target.exists():
        suffix += 1
        target = save_dir / f"{EARLIER_PREFIX}{stamp}-{suffix}"
    target.mkdir()
    if (save_dir / LATEST_NAME).exists():
        os.rename(save_dir / LATEST_NAME, target / LATEST_NAME)
    for _, path in steps:
        os.rename(path, target / path.name)
    fsync_dir(target)
    fsync_dir(save_dir)
    return target
