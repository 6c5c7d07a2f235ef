"""A collective that failed in a training worker, as one line: the rank, the collective, the step,
and, when it timed out, the ranks that did not take part.

gloo's own message says only that a send or receive timed out. Which ranks were missing is
found through the rendezvous store: every rank whose collective timed out writes its name
there and waits a moment for the others; a rank that never writes (stopped, hung before the
collective, or busy elsewhere) did not take part.
"""

from __future__ import annotations

import datetime
import time

import torch.distributed as dist

from ..dist.comm import CollectiveError
from ..errors import RunError

ROLL_CALL_SECONDS = 2.0  # how long a rank that timed out waits for the others to say so too


class CollectiveTimeout(RunError):
    """A collective did not complete within --timeout. Its message names the rank, the
    collective and the step, and the launcher reports it as it is."""


def collective_failure(
    error: CollectiveError, *, rank: int, world_size: int, step: int, timeout: float, units: set[str], attempt: int
) -> RunError:
    label = _describe_label(error.label, units)
    what = error.kind + (f" ({label})" if label else "")
    if not error.timed_out:
        return RunError(f"rank {rank}: {what} at step {step} failed: {error.reason}")
    missing = _absent_ranks(rank, world_size, attempt)
    if missing is None:
        absent = "another rank did not take part"
    elif missing:
        absent = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} did not take part"
    else:
        absent = "every rank was waiting (the ranks issued different collectives?)"
    return CollectiveTimeout(f"rank {rank} timed out after {timeout:g} s in {what} at step {step}: {absent}")


def _describe_label(label: str, units: set[str]) -> str:
    if label in units:
        return f"unit {label or '<root>'}"
    return label


def _absent_ranks(rank: int, world_size: int, attempt: int) -> list[int] | None:
    """The ranks that did not report a timeout within ROLL_CALL_SECONDS; None without a store."""
    prefix = f"fsdpkit/timed-out/{attempt}/"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=ROLL_CALL_SECONDS))  # its host may be the rank that stopped
        store.set(f"{prefix}{rank}", "1")
        others = [r for r in range(world_size) if r != rank]
        deadline = time.monotonic() + ROLL_CALL_SECONDS
        while True:
            missing = [r for r in others if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # the store is gone too (its host failed): say what is known
        return [1 - rank] if world_size == 2 else None
