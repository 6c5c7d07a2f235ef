"""Attempts of one `fsdpkit train`: torch's elastic agent restarts the worker group after a
failure (--max-restarts), and the restarted workers continue the same run. What carries over:

- the run id (`RunContext.run_id`, the run directory lock's): a restarted worker resumes from
  the newest checkpoint carrying it, and `--keep-last` keeps pruning the run's own checkpoints;
- the progress file (`RunContext.progress_path`, a temporary file the launcher owns): each
  node's local rank 0 appends one JSON line when an attempt starts and one per step, so that
  the last attempt reports every step's loss, how many steps were run again because they came
  after the last checkpoint (steps_redone), and knows where the --metrics file stood after
  any step (it cuts off the steps it runs again).

Under torchrun there is no progress file: a restarted worker still resumes, but reports only
the steps it ran itself.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def attempt_number() -> int:
    """0 for the first attempt, n after the agent's n-th restart."""
    text = os.environ.get(RESTART_COUNT_ENV, "0")
    return int(text) if text.isdigit() else 0


@dataclass(frozen=True)
class RunContext:
    """What the launcher gives every attempt's workers."""

    run_id: str | None = None  # the lock's run id; None without --save-dir
    progress_path: str | None = None


@dataclass
class History:
    """What the attempts recorded, in order (pure arithmetic on the records)."""

    first_step: int | None = None  # where this invocation started (None: nothing recorded)
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    metrics_offsets: dict[int, int] = field(default_factory=dict)  # --metrics file size after step s
    spans: dict[int, list[int]] = field(default_factory=dict)  # attempt -> [start step, last step run]

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> History:
        history = cls()
        for record in records:
            attempt = record["attempt"]
            if "start" in record:
                start = record["start"]
                history.spans[attempt] = [start, start]
                if history.first_step is None:
                    history.first_step = start
                at = start
            else:
                at = record["step"]
                history.losses[at] = record["loss"]
                if "eval_loss" in record:
                    history.eval_losses[at] = record["eval_loss"]
                span = history.spans.setdefault(attempt, [at - 1, at - 1])
                span[1] = max(span[1], at)
            if record.get("metrics_offset") is not None:
                history.metrics_offsets[at] = record["metrics_offset"]
        return history

    def steps_redone(self, start: int) -> int:
        """Steps an earlier attempt ran that a later one ran again, the attempt starting at
        `start` now included."""
        spans = [self.spans[a] for a in sorted(self.spans)] + [[start, start]]
        return sum(max(0, before[1] - after[0]) for before, after in pairwise(spans))

    def steps_before(self, start: int) -> range:
        """The steps of this invocation that earlier attempts ran and a run from `start` keeps."""
        return range(self.first_step + 1 if self.first_step is not None else start + 1, start + 1)


def read_records(path: str) -> list[dict[str, Any]]:
    """The progress file's records; a line cut short by a killed writer is skipped."""
    records = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    except FileNotFoundError:
        pass
    return records


class ProgressLog:
    """This attempt's records, appended to the progress file; `history` holds the earlier ones."""

    def __init__(self, path: str, attempt: int) -> None:
        self.attempt = attempt
        self.history = History.of(read_records(path))
        self.file = open(path, "a", encoding="utf-8")

    def _write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({"attempt": self.attempt, **record}) + "\n")
        self.file.flush()

    def started(self, step: int, *, metrics_offset: int | None) -> None:
        self._write({"start": step, "metrics_offset": metrics_offset})

    def stepped(self, step: int, loss: float, *, eval_loss: float | None, metrics_offset: int | None) -> None:
        record: dict[str, Any] = {"step": step, "loss": loss, "metrics_offset": metrics_offset}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self._write(record)

    def close(self) -> None:
        self.file.close()
