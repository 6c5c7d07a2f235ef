"""`--dry-run`: the plan of a spread command without running it: files and bytes per rank, the
largest share against the mean, and a predicted time from a read bandwidth measured on the
source (its largest file, up to MEASURE_BYTES; a file in the page cache reads faster than the
disk behind it, so the prediction is a lower bound there)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ...sizes import format_size
from ..core.files import close, open_regular, pread_into
from ..storage.location import is_url, open_storage
from .jobs import source_listing
from .plan import Plan
from .runner import SpreadTask, task_plan

MEASURE_BYTES = 64 << 20
BLOCK_BYTES = 4 << 20


@dataclass(frozen=True)
class DryRun:
    plan: Plan
    read_bytes_per_second: float  # measured, one process
    measured_on: str

    @property
    def predicted_seconds(self) -> float:
        """The largest share read at the measured rate (every process reading at that rate)."""
        return max(self.plan.rank_bytes()) / self.read_bytes_per_second if self.read_bytes_per_second else 0.0

    def to_json(self) -> dict:
        plan = self.plan
        shares = plan.rank_bytes()
        return {
            "world_size": plan.world_size,
            "bytes": plan.total_bytes,
            "largest_share_vs_mean": round(plan.imbalance, 4),
            "read_bytes_per_second": round(self.read_bytes_per_second),
            "measured_on": self.measured_on,
            "predicted_seconds": round(self.predicted_seconds, 3),
            "ranks": [
                {"rank": rank, "bytes": shares[rank], "parts": [plan.label(p) for p in plan.parts_of(rank)]}
                for rank in range(plan.world_size)
            ],
            "notes": list(plan.notes),
        }

    def lines(self) -> list[str]:
        plan = self.plan
        shares = plan.rank_bytes()
        out = [
            f"plan: {len(plan.files)} files, {format_size(plan.total_bytes)} over {plan.world_size} ranks; "
            f"largest share {format_size(max(shares))} = {plan.imbalance:.3f}x the mean"
        ]
        for rank in range(plan.world_size):
            parts = plan.parts_of(rank)
            names = ", ".join(plan.label(p) for p in parts[:3]) + (f", ... (+{len(parts) - 3})" if len(parts) > 3 else "")
            out.append(f"  rank {rank}: {len(parts)} parts, {format_size(shares[rank])}: {names or '(nothing)'}")
        out += [f"  note: {note}" for note in plan.notes]
        rate = f"{format_size(int(self.read_bytes_per_second))}/s"
        out.append(f"predicted: {self.predicted_seconds:.1f} s at {rate} per process (read from {self.measured_on})")
        return out


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
    rate, where = read_bandwidth(task.src)
    return DryRun(task_plan(task, job, world_size), rate, where)
