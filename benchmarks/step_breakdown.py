"""Where a training step's time goes, per system, from the torch profiler's trace.

Every instant of the training thread's step is given to one category, by the innermost
profiler event running on that thread at that instant and the events around it:

  compute       model math: forward ops and the ops of backward's autograd nodes, outside
                any framework hook region (fsdpkit:*, FSDP::*, FullyShardedDataParallel._*)
  exposed comm  the training thread issuing a collective (c10d::*), or blocked waiting
                for one: a stretch with no op running, from its start up to the last
                completion of a collective (the end of a gloo:* span, on gloo's worker
                threads or, for point-to-point transfers, the training thread) inside it.
                Communication that completes while the thread computes is hidden and
                not counted.
  engine ops    ops the parallel framework runs itself: in its hook regions, in
                AccumulateGrad, or in end-of-backward callbacks (copies, casts, zeroing,
                gradient division, gradient-bucket work)
  optimizer     optimizer.step() and zero_grad()
  overhead      the rest: Python in hooks and module calls, autograd bookkeeping, the
                interpreter between ops (no op running and no collective finishing)

`comm busy` is the union of the collectives' spans (gloo:*); the
part of it not exposed ran hidden under other work. Profiling slows small ops, so the shares
matter more than the absolute milliseconds; the timed trials are measured without it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

DEFINITION = """\
compute: model ops (forward, backward's autograd nodes) outside framework hooks
exposed_comm: training thread issuing a collective, or blocked until one completes
engine_ops: ops the framework runs itself (hooks, AccumulateGrad, end-of-backward): copies, casts, zeroing, division
optimizer: optimizer.step() and zero_grad()
overhead: the rest: Python in hooks and module calls, autograd bookkeeping, time between ops
comm busy: union of the collectives' spans, start to completion (exposed + hidden under other work)"""
CATEGORIES = ("compute", "exposed_comm", "engine_ops", "optimizer", "overhead")
FRAMEWORK_PREFIXES = ("fsdpkit:", "FSDP::", "FullyShardedDataParallel._")
COMM_PREFIXES = ("c10d::", "record_param_comms")  # ops that issue a collective
SPAN_PREFIXES = ("gloo:", "nccl:")  # a collective's life, issue or start to completion, on any thread
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
STEP, FORWARD, BACKWARD, OPTIMIZER = "bench:step", "bench:forward", "bench:backward", "bench:optimizer"


@dataclass(frozen=True)
class Event:
    name: str
    thread: int
    start: float  # microseconds
    end: float


@dataclass
class Breakdown:
    """Microseconds per category, summed over the profiled steps."""

    steps: int = 0
    step_us: float = 0.0
    comm_busy_us: float = 0.0
    us: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))

    def add(self, other: Breakdown) -> None:
        self.steps += other.steps
        self.step_us += other.step_us
        self.comm_busy_us += other.comm_busy_us
        for name, value in other.us.items():
            self.us[name] += value

    def per_step_ms(self) -> dict[str, float]:
        scale = 1e-3 / max(self.steps, 1)
        return {
            "step": self.step_us * scale,
            "comm_busy": self.comm_busy_us * scale,
            **{name: value * scale for name, value in self.us.items()},
        }


def _is_comm(name: str) -> bool:
    return name.startswith(COMM_PREFIXES)


def _is_span(name: str) -> bool:
    return name.startswith(SPAN_PREFIXES)


def _is_region(name: str) -> bool:
    """A labelled region rather than an op (its self time is Python, not kernel work)."""
    return name.startswith(("bench:", AUTOGRAD_NODE, "DistributedDataParallel.", "FullyShardedDataParallel.")) or name.startswith(
        FRAMEWORK_PREFIXES
    )


def _classify(stack: list[str]) -> str | None:
    """The category of an instant whose innermost event is stack[-1]; None: no op running
    (overhead, or waiting on a collective: decided by the caller)."""
    if any(_is_comm(name) for name in stack):
        return "exposed_comm"
    if OPTIMIZER in stack:
        return "optimizer"
    if not stack or _is_region(stack[-1]):
        return None
    if any(name.startswith(FRAMEWORK_PREFIXES) for name in stack):
        return "engine_ops"
    if BACKWARD in stack:
        nodes = [name for name in stack if name.startswith(AUTOGRAD_NODE)]
        if not nodes or "AccumulateGrad" in nodes[-1]:
            return "engine_ops"
    return "compute"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in intervals)


def analyse(events: list[Event]) -> Breakdown:
    """The breakdown of every `bench:step` region in `events` (one rank's trace)."""
    steps = [e for e in events if e.name == STEP]
    result = Breakdown(steps=len(steps))
    if not steps:
        return result
    thread = steps[0].thread
    spans = [e for e in events if _is_span(e.name)]
    comm_ends = sorted(e.end for e in spans)
    comm_busy = _union((e.start, e.end) for e in spans)
    own = sorted((e for e in events if e.thread == thread and not _is_span(e.name)), key=lambda e: (e.start, -e.end))
    for step in steps:
        result.step_us += step.end - step.start
        result.comm_busy_us += _clip(comm_busy, step.start, step.end)
        inside = [e for e in own if e.start >= step.start and e.end <= step.end]
        for category, start, end in _segments(inside, step.start, step.end, comm_ends):
            result.us[category] += end - start
    return result


def _segments(events: list[Event], lo: float, hi: float, comm_ends: list[float]):
    """(category, start, end) covering [lo, hi] once."""
    pieces: list[tuple[str | None, float, float]] = []
    stack: list[Event] = []
    cursor = lo

    def emit(until: float) -> None:
        nonlocal cursor
        if until > cursor:
            pieces.append((_classify([e.name for e in stack]), cursor, until))
            cursor = until

    for event in events:
        while stack and stack[-1].end <= event.start:
            emit(stack[-1].end)
            stack.pop()
        emit(event.start)
        stack.append(event)
    while stack:
        emit(stack[-1].end)
        stack.pop()
    emit(hi)
    # Merge adjacent no-op stretches, then split each into waiting and overhead.
    merged: list[list[Any]] = []
    for category, start, end in pieces:
        if merged and category is None and merged[-1][0] is None and merged[-1][2] == start:
            merged[-1][2] = end
        else:
            merged.append([category, start, end])
    for category, start, end in merged:
        if category is not None:
            yield category, start, end
            continue
        last = bisect.bisect_right(comm_ends, end) - 1
        completion = comm_ends[last] if last >= 0 else start
        if completion > start:
            yield "exposed_comm", start, completion
        if end > max(completion, start):
            yield "overhead", max(completion, start), end


def events_of(prof: Any) -> list[Event]:
    """The profiler's CPU events as plain records."""
    return [Event(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()]


def profile_breakdown(run_steps: Callable[[int], None], steps: int) -> Breakdown:
    """Run `steps` training steps under the profiler (each inside a `bench:step` region)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(steps)
    return analyse(events_of(prof))
