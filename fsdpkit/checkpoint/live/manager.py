"""The one owner of a run's checkpoint directory (`--save-dir`), as torchtitan's CheckpointManager
is: the lock on it, whose checkpoints it holds (save_dir.py: one run per directory, --new-run
sets the others aside), the newest step this run saved, keep-last-k, the removal of saves a
failure cut short, async saves, and loading from it or from any other checkpoint. `fsdpkit train`
talks to this module alone about checkpoints on disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..format import storage
from ..format.lock import RunLock
from ..format.manifest import Manifest, load_manifest
from ..format.names import parse_step_dir_name
from ..format.save_dir import check_save_dir, continued_run_id, set_aside
from .checkpointer import Checkpointer, check_before_launch, init_weights_from
from .save_protocol import SaveTimings

__all__ = [
    "CheckpointManager",
    "RunLock",
    "check_before_launch",
    "check_save_dir",
    "continued_run_id",
    "init_weights_from",
    "saved_checkpoint",
    "set_aside",
]


def saved_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    """The step directory that `path` (a run or step directory) denotes, and its manifest; a
    missing or corrupt checkpoint raises the reader's UsageError / DataCheckError."""
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
        self.save_dir = Path(save_dir) if save_dir else None
        self.model, self.optimizer = model, optimizer
        self.keep_last, self.run_id = keep_last, run_id
        self.checkpointer = Checkpointer(model, optimizer, async_save=async_save, run_id=run_id) if self.save_dir else None

    @property
    def saves(self) -> bool:
        return self.checkpointer is not None

    @staticmethod
    def newest_of_run(save_dir: str | Path, run_id: str) -> Path | None:
        """The newest complete checkpoint run `run_id` saved in `save_dir` (a restarted attempt goes
        on from it; asked before the model it would load into is built)."""
        return storage.newest_of_run(save_dir, run_id=run_id)

    def remove_unfinished(self) -> None:
        """Remove the saves of this run a failure cut short (call on one rank, with no save in flight)."""
        if self.save_dir is not None and self.run_id is not None:
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
        return Checkpointer(self.model, self.optimizer).load(path, strict=strict)

    def init_weights(self, path: str | os.PathLike[str]) -> None:
        """Weights only, from a sharded or a full checkpoint (--init-from)."""
        init_weights_from(self.model, path)

    @staticmethod
    def step_of(step_dir: Path) -> int | None:
        """The step a step directory's name gives."""
        return parse_step_dir_name(step_dir.name)

    @property
    def stall_seconds(self) -> float:
        return self.checkpointer.stall_seconds if self.checkpointer is not None else 0.0

    @property
    def last_saved(self) -> str | None:
        return self.checkpointer.last_saved if self.checkpointer is not None else None

    @property
    def timings(self) -> SaveTimings | None:
        return self.checkpointer.timings if self.checkpointer is not None else None
