"""Per-step records on rank 0: one JSON line each in --metrics, the same scalars as
TensorBoard events in --tensorboard. `fsdpkit report` draws the JSON lines."""

from __future__ import annotations

import json
import os
from typing import Any

from ..errors import UsageError, install_hint


def check_tensorboard_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(f"--tensorboard needs the tensorboard package: {install_hint('tensorboard')}")


class MetricsLog:
    """A record is {"step": int, name: number, ...}; every number becomes a scalar.

    A restarted attempt continues the file where the step it resumed from ended (`cut_at`, a
    size in bytes from `offset`) and hides TensorBoard events from `purge_step` on, so that a
    step run again appears once."""

    def __init__(
        self, *, jsonl_path: str | None, tensorboard_dir: str | None, cut_at: int | None = None, purge_step: int | None = None
    ) -> None:
        self.jsonl = None
        if jsonl_path:
            self.jsonl = open(jsonl_path, "ab")
            if cut_at is not None and cut_at < self.jsonl.seek(0, os.SEEK_END):
                self.jsonl.truncate(cut_at)
                self.jsonl.seek(0, os.SEEK_END)
        self.tensorboard = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir, purge_step=purge_step)

    @property
    def offset(self) -> int | None:
        """The --metrics file's size now; None without one."""
        return self.jsonl.tell() if self.jsonl else None

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl:
            self.jsonl.write((json.dumps(record) + "\n").encode("utf-8"))
            self.jsonl.flush()
        if self.tensorboard:
            for name, value in record.items():
                if name != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(name, value, global_step=record["step"])

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tensorboard:
            self.tensorboard.close()
