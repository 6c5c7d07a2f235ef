"""Where rank 0's record of a training run goes: the progress log the launcher reads across
restarts, the --metrics file (and TensorBoard), the experiment trackers, and the progress bar
or lines."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from .. import log
from .attempts import ProgressLog, RunContext, attempt_number
from .metrics import MetricsLog
from .progress import Progress, progress_mode
from .trackers import Trackers, mlflow_uri, open_trackers

if TYPE_CHECKING:
    from .loop import Trainer


@dataclasses.dataclass
class Outputs:
    """Where rank 0's record of a run goes: the progress log the launcher reads across
    restarts, the metrics file, and the progress bar or lines."""

    progress_log: ProgressLog | None
    metrics: MetricsLog | None
    progress: Progress
    trackers: Trackers | None = None

    def close(self) -> None:
        self.progress.close()
        if self.trackers:
            self.trackers.close()
        if self.metrics:
            self.metrics.close()
        if self.progress_log:
            self.progress_log.close()


def open_outputs(trainer: Trainer, context: RunContext) -> Outputs:
    config, attempt, rank0 = trainer.config, attempt_number(), trainer.rank == 0
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    progress_log = ProgressLog(context.progress_path, attempt) if context.progress_path and local0 else None
    history = progress_log.history if progress_log else None
    logging = config.logging
    metrics = None
    if rank0:
        cut_at = history.metrics_offsets.get(trainer.start_step) if history and attempt else None
        metrics = MetricsLog(
            jsonl_path=logging.metrics,
            tensorboard_dir=logging.tensorboard,
            cut_at=cut_at,
            purge_step=trainer.start_step + 1 if attempt else None,
        )
    trackers = None
    if rank0 and (logging.wandb or logging.mlflow):
        trackers = open_trackers(
            wandb=logging.wandb,
            mlflow=mlflow_uri(logging.mlflow_uri) if logging.mlflow else None,
            config=config.to_values(),
            saved_ids=trainer.tracker_ids,
            logged_through=max(history.losses, default=0) if history and attempt else 0,
        )
        trainer.tracker_ids = trackers.ids
    if progress_log:
        progress_log.started(trainer.start_step, metrics_offset=metrics.offset if metrics else None, restart=trainer.restart())
    if rank0 and trainer.step < config.steps:
        log.note(f"training: step {trainer.step + 1} of {config.steps} starting")
    progress = Progress(
        progress_mode(quiet=logging.quiet, shown=rank0, stream=sys.stderr),
        total=config.steps,
        initial=trainer.step,
        every_steps=logging.log_every,
        every_seconds=logging.log_seconds,
    )
    return Outputs(progress_log, metrics, progress, trackers)
