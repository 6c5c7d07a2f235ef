"""Injected faults, FOR TESTS ONLY: the environment variable FSDPKIT_TEST_FAULT makes one rank
of a training run misbehave at a chosen step, in the first attempt only (a group that
torch's elastic agent restarts runs clean), so that tests hit a fault at a known point.

    FSDPKIT_TEST_FAULT=ACTION:RANK:STEP[:WHERE]

    kill:1:3              rank 1 SIGKILLs itself at the end of step 3
    kill:1:4:save         rank 1 SIGKILLs itself while saving step 4's checkpoint, right after
                          writing its own rank file (in the writer thread with --async-save)
    stop:1:3              rank 1 SIGSTOPs itself at the end of step 3
    full:0:4:snapshot     rank 0's snapshot of step 4 finds shared memory full (ENOSPC)
    kill:1:2:convert      rank 1 of a spread convert (or reshard, verify) SIGKILLs itself as it
                          starts its 2nd part (full:1:2:convert: that part's write finds the disk full)
    skip:1:3:all_gather   rank 1 does not take part in its first all_gather of step 3 (or another
                          collective kind: all_reduce, reduce_scatter, ...): it stops issuing
                          collectives there and waits, as a rank stuck before a collective would

Steps count from 1 (step 3 is the third training step). Without the variable every hook
here is one comparison.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

FAULT_ENV = "FSDPKIT_TEST_FAULT"
ACTIONS = ("kill", "stop", "skip", "full")


@dataclass(frozen=True)
class Fault:
    action: str
    rank: int
    step: int
    where: str  # "step" (the end of the step), "save", or a collective kind (skip)

    @classmethod
    def parse(cls, text: str) -> Fault:
        parts = text.split(":")
        if len(parts) not in (3, 4) or parts[0] not in ACTIONS or not parts[1].isdigit() or not parts[2].isdigit():
            raise ValueError(f"{FAULT_ENV}={text!r}: expected ACTION:RANK:STEP[:WHERE] with ACTION one of {', '.join(ACTIONS)}")
        where = parts[3] if len(parts) == 4 else "step"
        if parts[0] == "skip" and where == "step":
            raise ValueError(f"{FAULT_ENV}={text!r}: skip needs the collective kind, e.g. skip:1:3:all_gather")
        return cls(parts[0], int(parts[1]), int(parts[2]), where)


class _Plan:
    """This process's fault, if any, and the step it is in (set by the trainer)."""

    def __init__(self) -> None:
        text = os.environ.get(FAULT_ENV, "")
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        fault = Fault.parse(text) if text else None
        self.fault = fault if fault and first_attempt and str(fault.rank) == os.environ.get("RANK") else None
        self.step = 0  # the step in progress (1-based); 0 before training


_plan: _Plan | None = None


def _current() -> _Plan:
    global _plan
    if _plan is None:
        _plan = _Plan()
    return _plan


def step_started(step: int) -> None:
    """The trainer begins step `step` (1-based)."""
    _current().step = step


def reached(where: str, step: int) -> None:
    """A point the trainer or a writer passes: `where` is "step", "save" or "snapshot"."""
    fault = _current().fault
    if fault is None or fault.where != where or fault.step != step:
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "full":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def before_collective(kind: str, label: str) -> None:
    """Collectives calls this before issuing each collective."""
    plan = _current()
    fault = plan.fault
    if fault is None or fault.action != "skip" or fault.where != kind or fault.step != plan.step:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the agent's SIGTERM ends this process at once
    while True:  # never take part; the launcher ends this process when the others time out
        time.sleep(1)
