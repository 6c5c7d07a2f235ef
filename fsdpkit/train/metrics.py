"""Per-step records on rank 0: one JSON line each in --metrics, the same scalars as
TensorBoard events in --tensorboard. `fsdpkit report` draws the JSON lines."""

from __future__ import annotations

import json
from typing import Any

from ..errors import UsageError

TENSORBOARD_HINT = "pip install 'fsdpkit[tensorboard]'"


def check_tensorboard_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise UsageError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")


class MetricsLog:
    """A record is {"step": int, name: number, ...}; every number becomes a scalar."""

    def __init__(self, *, jsonl_path: str | None, tensorboard_dir: str | None) -> None:
        self.jsonl = open(jsonl_path, "a", encoding="utf-8") if jsonl_path else None
        self.tensorboard = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)

    def write(self, record: dict[str, Any]) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
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
