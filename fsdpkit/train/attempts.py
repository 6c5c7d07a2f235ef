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

import dataclasses
import json
import os
import time
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
    snapshot_dir: str | None = None  # this node's snapshot store (None: no snapshots)


@dataclass(frozen=True)
class Restart:
    """How an attempt started: where its state came from (`source`: memory, peer, disk, or
    none for step 0), and wall-clock times: the worker began, joined the process group, had
    its state restored."""

    source: str
    started: float
    joined: float
    restored: float


@dataclass
class History:
    """What the attempts recorded, in order (pure arithmetic on the records)."""

    first_step: int | None = None  # where this invocation started (None: nothing recorded)
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)
    metrics_offsets: dict[int, int] = field(default_factory=dict)  # --metrics file size after step s
    spans: dict[int, list[int]] = field(default_factory=dict)  # attempt -> [start step, last step run]
    starts: dict[int, dict[str, Any]] = field(default_factory=dict)  # attempt -> its start record
    last_seen: dict[int, float] = field(default_factory=dict)  # attempt -> time of its last record
    first_step_at: dict[int, float] = field(default_factory=dict)  # attempt -> time its first step completed

    @classmethod
    def of(cls, records: list[dict[str, Any]]) -> History:
        history = cls()
        for record in records:
            attempt = record["attempt"]
            if "t" in record:
                history.last_seen[attempt] = record["t"]
            if "start" in record:
                start = record["start"]
                history.starts[attempt] = record
                history.spans[attempt] = [start, start]
                if history.first_step is None:
                    history.first_step = start
                at = start
            else:
                at = record["step"]
                history.losses[at] = record["loss"]
                if "t" in record:
                    history.first_step_at.setdefault(attempt, record["t"])
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

    def recoveries(self) -> list[dict[str, Any]]:
        """One record per restart: where it resumed from, its step, the steps it ran again, and
        the seconds from the failure (the failed attempt's last record) to its first completed
        step, with the part spent until the worker began (relaunch), joining the group
        (rendezvous) and restoring the state (restore)."""
        out = []
        attempts = sorted(self.starts)
        for before, after in pairwise(attempts):
            start = self.starts[after]
            failed_at = self.last_seen.get(before)
            step = start["start"]
            record: dict[str, Any] = {
                "source": start.get("source", "disk"),
                "step": step,
                "steps_redone": max(0, self.spans[before][1] - step),
                "recovery_s": None,
                "relaunch_s": None,
                "rendezvous_s": None,
                "restore_s": None,
            }
            if failed_at is not None and "started" in start:
                done = self.first_step_at.get(after)
                record["recovery_s"] = done - failed_at if done is not None else None
                record["relaunch_s"] = start["started"] - failed_at
                record["rendezvous_s"] = start["joined"] - start["started"]
                record["restore_s"] = start["restored"] - start["joined"]
            out.append(record)
        return out

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
        self.file.write(json.dumps({"attempt": self.attempt, "t": time.time(), **record}) + "\n")
        self.file.flush()

    def started(self, step: int, *, metrics_offset: int | None, restart: Restart | None) -> None:
        self._write({"start": step, "metrics_offset": metrics_offset, **(dataclasses.asdict(restart) if restart else {})})

    def stepped(self, step: int, loss: float, *, eval_loss: float | None, metrics_offset: int | None) -> None:
        record: dict[str, Any] = {"step": step, "loss": loss, "metrics_offset": metrics_offset}
        if eval_loss is not None:
            record["eval_loss"] = eval_loss
        self._write(record)

    def close(self) -> None:
        self.file.close()
