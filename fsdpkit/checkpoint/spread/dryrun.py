"""`--dry-run`: the plan of a spread command without running it: files and bytes per rank, the
largest share against the mean, and a predicted time from a read bandwidth measured on the
source (its largest file, up to MEASURE_BYTES; a file in the page cache reads faster than the
disk behind it, so the prediction is a lower bound there). A command that writes makes every
check the run makes before it writes (DST, a staging area of another conversion, free space:
the same line, the same exit code) and says which finished parts of DST's staging area the run
keeps, or, with --restart, what it discards."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...sizes import count as count_of
from ...sizes import format_size
from ..core.files import close, open_regular, pread_into
from ..storage.location import is_url, open_storage
from .jobs import source_listing
from .plan import Plan
from .runner import SpreadTask, checked_staging, task_plan
from .staging import Staging, fingerprint, kept_parts

MEASURE_BYTES = 64 << 20
BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class Staged:
    """What DST's staging area holds for the run: the finished parts it keeps, or (--restart) discards."""

    where: str
    exists: bool
    restart: bool
    kept: frozenset[tuple[int, int]] = frozenset()  # (file, index) of the plan's parts not written again
    discarded_parts: int = 0
    discarded_bytes: int = 0


@dataclass(frozen=True)
class DryRun:
    plan: Plan
    read_bytes_per_second: float  # measured, one process
    measured_on: str
    staged: Staged | None = None  # a command that writes

    def left_bytes(self) -> list[int]:
        """Each rank's bytes still to write (its share less the parts kept)."""
        kept = self.staged.kept if self.staged is not None else frozenset()
        left = [0] * self.plan.world_size
        for part, owner in zip(self.plan.parts, self.plan.owners, strict=True):
            left[owner] += 0 if (part.file, part.index) in kept else part.nbytes
        return left

    @property
    def kept_bytes(self) -> int:
        return self.plan.total_bytes - sum(self.left_bytes())

    @property
    def predicted_seconds(self) -> float:
        """The largest share still to write read at the measured rate (every process reading at that rate)."""
        return max(self.left_bytes()) / self.read_bytes_per_second if self.read_bytes_per_second else 0.0

    def to_json(self) -> dict:
        plan, staged = self.plan, self.staged
        shares, kept = plan.rank_bytes(), staged.kept if staged is not None else frozenset()
        return {
            "world_size": plan.world_size,
            "bytes": plan.total_bytes,
            "largest_share_vs_mean": round(plan.imbalance, 4),
            "read_bytes_per_second": round(self.read_bytes_per_second),
            "measured_on": self.measured_on,
            "predicted_seconds": round(self.predicted_seconds, 3),
            "staging": staged.where if staged is not None else None,
            "kept_parts": len(kept),
            "kept_bytes": self.kept_bytes,
            "discarded_parts": staged.discarded_parts if staged is not None else 0,
            "discarded_bytes": staged.discarded_bytes if staged is not None else 0,
            "ranks": [
                {
                    "rank": rank,
                    "bytes": shares[rank],
                    "parts": [plan.label(p) for p in plan.parts_of(rank)],
                    "kept_parts": sum((p.file, p.index) in kept for p in plan.parts_of(rank)),
                }
                for rank in range(plan.world_size)
            ],
            "notes": list(plan.notes),
        }

    def lines(self) -> list[str]:
        plan = self.plan
        shares = plan.rank_bytes()
        out = [
            f"plan: {count_of(len(plan.files), 'file')}, {format_size(plan.total_bytes)} over {count_of(plan.world_size, 'rank')}; "
            f"largest share {format_size(max(shares))} = {plan.imbalance:.3f}x the mean"
        ]
        for rank in range(plan.world_size):
            parts = plan.parts_of(rank)
            names = ", ".join(plan.label(p) for p in parts[:3]) + (f", ... (+{len(parts) - 3})" if len(parts) > 3 else "")
            out.append(f"  rank {rank}: {count_of(len(parts), 'part')}, {format_size(shares[rank])}: {names or '(nothing)'}")
        out += [f"  note: {note}" for note in plan.notes]
        out += self._staged_lines()
        rate = f"{format_size(int(self.read_bytes_per_second))}/s"
        out.append(f"predicted: {self.predicted_seconds:.1f} s at {rate} per process (read from {self.measured_on})")
        return out

    def _staged_lines(self) -> list[str]:
        """What the run does with DST's staging area, when there is one (or --restart asks)."""
        staged = self.staged
        if staged is None or not (staged.exists or staged.restart):
            return []
        if staged.restart:
            if not staged.exists:
                return [f"--restart: nothing to discard ({staged.where} is not there)"]
            done = f"{count_of(staged.discarded_parts, 'finished part')}, {format_size(staged.discarded_bytes)}"
            return [f"--restart discards {staged.where} ({done}): every part is written again"]
        return [
            f"kept: {len(staged.kept)} of {len(self.plan.parts)} parts ({format_size(self.kept_bytes)}) finished in {staged.where} "
            "by an earlier run are not written again (--restart discards them)"
        ]


def read_bandwidth(src: str) -> tuple[float, str]:
    """Bytes per second one process reads from the largest file of `src`, and that file's name."""
    if is_url(src):
        return _object_bandwidth(src)
    root = Path(src)
    listing = source_listing(root)
    if not listing:
        return 0.0, "nothing"
    name, size, _ = max(listing, key=lambda entry: entry[1])
    path = root / name if root.is_dir() else root
    fd, size = open_regular(path)
    buffer = memoryview(bytearray(BLOCK_BYTES))
    done, started = 0, time.perf_counter()
    try:
        while done < min(size, MEASURE_BYTES):
            count = min(BLOCK_BYTES, size - done)
            pread_into(fd, done, buffer[:count], path)
            done += count
    finally:
        close(fd)
    seconds = time.perf_counter() - started
    return (done / seconds if seconds > 0 else 0.0), f"{name} ({format_size(done)})"


def _object_bandwidth(url: str) -> tuple[float, str]:
    """`read_bandwidth` of the largest object under `url`, read through the storage face."""
    storage = open_storage(url)
    listing = storage.list()
    if not listing:
        return 0.0, "nothing"
    name, size = max(listing.items(), key=lambda entry: entry[1])
    done, started = 0, time.perf_counter()
    for _, block in storage.read_blocks(name, [(0, min(size, MEASURE_BYTES))], block_bytes=BLOCK_BYTES):
        done += block.nbytes
    seconds = time.perf_counter() - started
    return (done / seconds if seconds > 0 else 0.0), f"{name} ({format_size(done)})"


def dry_run(job, task: SpreadTask, world_size: int) -> DryRun:
    """The plan of `task` at `world_size` ranks, after every check the run makes before it writes."""
    plan = task_plan(task, job, world_size)
    staged = _staged(task, job, plan) if task.writes else None
    rate, where = read_bandwidth(task.src)
    return DryRun(plan, rate, where, staged)


def _staged(task: SpreadTask, job, plan: Plan) -> Staged:
    """The run's checks of DST (a UsageError or RunError as the run raises it) and what its staging area holds."""
    staging = checked_staging(task, job, fingerprint(job.facts()), plan)
    try:
        records = staging.records()
        exists = bool(records) or (isinstance(staging, Staging) and staging.path.exists())
        if task.restart:
            return Staged(
                staging.where, exists, True, discarded_parts=len(records), discarded_bytes=sum(r.end - r.begin for r in records.values())
            )
        return Staged(staging.where, exists, False, kept=frozenset(kept_parts(plan, records)))
    finally:
        staging.close()
