"""The one owner of a run's checkpoint directory (`--save-dir`), as torchtitan's CheckpointManager
is: the lock on it, whose checkpoints it holds (save_dir.py: one run per directory, --new-run
sets the others aside), the newest step this run saved, keep-last-k, the removal of saves a
failure cut short, async saves, and loading from it or from any other checkpoint. `fsdpkit train`
talks to this module alone about checkpoints on disk.

`save_dir`, `--resume` and `--init-from` may be object-store URLs (`s3://bucket/prefix`): saves
stream each rank's file into the store from the same host buffers (format/run_store.py), and a
load copies the step through the storage face into a temporary directory first (TMPDIR).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..format import run_store, storage
from ..format.lock import RunLock
from ..format.manifest import Manifest, load_manifest
from ..format.names import parse_step_dir_name
from ..format.run_store import check_reachable
from ..format.save_dir import check_save_dir, continued_run_id, set_aside
from ..storage.location import is_url, open_storage

if TYPE_CHECKING:  # torch is imported when a run starts, not while its flags are checked
    import torch
    import torch.nn as nn

    from .save_protocol import SaveTimings

__all__ = [
    "CheckpointManager",
    "RunLock",
    "check_before_launch",
    "check_reachable",
    "check_save_dir",
    "continued_run_id",
    "saved_checkpoint",
    "set_aside",
]


def saved_checkpoint(path: str | os.PathLike[str]) -> tuple[str | Path, Manifest]:
    """The step directory (or URL) that `path` (a run or step directory, or URL) denotes, and its
    manifest; a missing or corrupt checkpoint raises the reader's UsageError / DataCheckError."""
    if is_url(path):
        return run_store.resolve_url(str(path))
    step_dir = storage.resolve_checkpoint(path)
    return step_dir, load_manifest(step_dir)


class CheckpointManager:
    """A run's checkpoints in `save_dir` (None: the run saves nothing, but still loads). Every rank
    makes one and calls save/wait/load together; `run_id` names the run (its lock's), so that
    keep-last-k and the removal of unfinished saves touch only this run's directories."""

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        async_save: bool = False,
        keep_last: int | None = None,
        run_id: str | None = None,
    ) -> None:
        self.save_dir = _location(save_dir) if save_dir else None
        self.model, self.optimizer = model, optimizer
        self.keep_last, self.run_id = keep_last, run_id
        from .checkpointer import Checkpointer

        self.checkpointer = Checkpointer(model, optimizer, async_save=async_save, run_id=run_id) if self.save_dir else None

    @property
    def saves(self) -> bool:
        return self.checkpointer is not None

    @staticmethod
    def newest_of_run(save_dir: str | Path, run_id: str) -> str | Path | None:
        """The newest complete checkpoint run `run_id` saved in `save_dir` (a restarted attempt goes
        on from it; asked before the model it would load into is built)."""
        if is_url(save_dir):
            return run_store.newest_of_run(str(save_dir), run_id=run_id)
        return storage.newest_of_run(save_dir, run_id=run_id)

    def remove_unfinished(self) -> None:
        """Remove the saves of this run a failure cut short (call on one rank, with no save in flight)."""
        if isinstance(self.save_dir, str):
            run_store.remove_unfinished(open_storage(self.save_dir))
        elif self.save_dir is not None and self.run_id is not None:
            storage.remove_unfinished(self.save_dir, run_id=self.run_id)

    def save(self, *, step: int, training_state: dict[str, Any]) -> None:
        """Step `step` saved into `save_dir` (in the background with async saves), then keep-last-k."""
        if self.checkpointer is None or self.save_dir is None:
            raise AssertionError("CheckpointManager.save() without a save directory")
        self.checkpointer.save(self.save_dir, step=step, training_state=training_state, keep_last=self.keep_last)

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        if self.checkpointer is not None:
            self.checkpointer.wait()

    def load(self, path: str | os.PathLike[str], *, strict: bool = True) -> dict[str, Any]:
        """Model and optimizer state from the checkpoint at `path` (saved at any world size); its training state."""
        from .checkpointer import Checkpointer

        return Checkpointer(self.model, self.optimizer).load(path, strict=strict)

    def init_weights(self, path: str | os.PathLike[str]) -> None:
        """Weights only, from a sharded or a full checkpoint (--init-from)."""
        from .checkpointer import init_weights_from

        init_weights_from(self.model, path)

    @staticmethod
    def step_of(step_dir: str | Path) -> int | None:
        """The step a step directory's name (or URL) gives."""
        return parse_step_dir_name(str(step_dir).rstrip("/").rpartition("/")[2])

    @property
    def stall_seconds(self) -> float:
        return self.checkpointer.stall_seconds if self.checkpointer is not None else 0.0

    @property
    def last_saved(self) -> str | None:
        return self.checkpointer.last_saved if self.checkpointer is not None else None

    @property
    def timings(self) -> SaveTimings | None:
        return self.checkpointer.timings if self.checkpointer is not None else None


def check_before_launch(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool) -> None:
    """The checkpoint at `path` checked against the unsharded meta model (and its optimizer when
    resuming) before any process starts: a problem is a DataCheckError (exit 3)."""
    from . import checkpointer

    stored = run_store.checked_stored(str(path)) if is_url(path) else None
    if stored is not None:  # its manifest and the rank files' headers, read in the bucket
        checkpointer.check_before_launch(path, model=model, optimizer=optimizer, strict=strict, stored=stored)
        return
    checkpointer.check_before_launch(checkpointer.checkpoint_path(path), model=model, optimizer=optimizer, strict=strict)


def _location(save_dir: str | os.PathLike[str]) -> str | Path:
    """A URL as it is (a Path would fold its `//`), a local directory as a Path."""
    return str(save_dir).rstrip("/") if is_url(save_dir) else Path(save_dir)
