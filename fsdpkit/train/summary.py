"""What a training run reports when it ends: `fsdpkit train` prints it as text, or with --json
as one JSON document (`to_json`, the contract scripts read)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainSummary:
    model: str
    num_params: int
    world_size: int
    strategy: str
    mixed_precision: str
    device: str
    steps: int  # the step count reached
    resumed_from_step: int | None  # the step --resume continued from (None: a fresh run)
    optimizer_steps: int  # steps the optimizer took (fp16 skips do not count)
    global_batch_size: int
    seq_len: int
    losses: list[float]  # one per step run, over every attempt
    eval_losses: list[dict[str, Any]]  # {"step": s, "loss": l}
    tokens_per_second: float  # the global batch of every step this process ran, over elapsed_seconds
    step_tokens_per_second: float | None  # the same over the steps' own time, every step but the first
    elapsed_seconds: float  # the first step's start to the last save's end: saves and snapshots included
    peak_memory_bytes: int  # max over ranks
    checkpoint: str | None  # the last checkpoint saved (None: no --save-dir)
    save_stall_s: float  # training-thread time spent in saves between steps, max over ranks
    snapshot_stall_s: float  # training-thread time spent in snapshots, max over ranks
    save_timings: dict[str, Any] | None
    restarts: int
    steps_redone: int | None  # steps run again after restarts (None: not known)
    preempted: bool  # stopped by SIGTERM before the step count
    # one per restart: source (memory, peer, disk, none), step, steps_redone, recovery_s (the
    # failure to the next completed step) and its parts relaunch_s, rendezvous_s, restore_s
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    lr: float | None = None  # the peak learning rate the run used (--lr or the model's default)

    @property
    def final_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "final_loss": self.final_loss}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> TrainSummary:
        return cls(**{key: value for key, value in document.items() if key != "final_loss"})
