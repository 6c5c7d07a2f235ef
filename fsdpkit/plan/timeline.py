"""The unsharded bytes in flight during one training step, by replaying the engine's step
policy (fsdpkit.engine.step_policy) on numbers only (no tensors, no process group).

Each gathered unit holds its full parameter until it reshards; a full gradient is held
from the moment it exists until its reduction completes, and the reduction's output buffer
from its issue. The peak is the largest sum at any event of the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.step_policy import Op, StepPolicy, step_events


@dataclass(frozen=True)
class UnitFootprint:
    """What one unit holds while unsharded (bytes on the compute device)."""

    name: str
    param_bytes: int  # the full padded flat parameter (0 when it aliases the shard)
    grad_bytes: int  # the full padded gradient (+ a reduce-dtype copy), until reduced
    trainable: bool = True
    reduced_bytes: int = 0  # the sharded gradient the reduction leaves (master dtype, device)
    issued_bytes: int = 0  # the reduction's output buffer from its issue (reduce dtype) until it completes
    reduced_on_completion: bool = False  # F = 1: the reduction works in place on the full gradient


@dataclass(frozen=True)
class Peak:
    bytes: int
    params: tuple[str, ...]  # units whose unsharded parameters are held at the peak
    grads: tuple[str, ...]  # units whose full gradients are held at the peak
    phase: str  # "forward" or "backward"


class _Tracker:
    def __init__(self, units: list[UnitFootprint]) -> None:
        self.units = {unit.name: unit for unit in units}
        self.params: dict[str, int] = {}
        self.grads: dict[str, int] = {}
        self.reduced: dict[str, int] = {}
        self.peak = Peak(0, (), (), "forward")

    def total(self) -> int:
        return sum(self.params.values()) + sum(self.grads.values()) + sum(self.reduced.values())

    def observe(self, phase: str) -> None:
        if self.total() > self.peak.bytes:
            self.peak = Peak(self.total(), tuple(self.params), tuple(self.grads), phase)

    def unshard(self, name: str) -> None:
        self.params.setdefault(name, self.units[name].param_bytes)

    def reshard(self, name: str) -> None:
        self.params.pop(name, None)

    def complete(self, name: str) -> None:
        self.grads.pop(name, None)
        self.reduced[name] = self.units[name].reduced_bytes


def peak_unsharded(units: list[UnitFootprint], policy: StepPolicy) -> Peak:
    """The largest sum of unsharded parameters and gradients held at any point of a step,
    with the sharded gradients produced so far (the engine frees them when the optimizer
    clears .grad, and rebuilds them during backward).

    `units[0]` is the root; the rest are in forward order.
    """
    if not units:
        return Peak(0, (), (), "forward")
    tracker = _Tracker(units)
    phase, forwarded = "forward", set()
    for event in step_events([(unit.name, unit.trainable) for unit in units], policy):
        unit = tracker.units.get(event.unit)
        if event.op is Op.FORWARD:
            forwarded.add(event.unit)
        elif event.op is Op.WAIT and event.unit in forwarded:
            phase = "backward"
        if event.op is Op.GATHER:
            tracker.unshard(event.unit)
        elif event.op is Op.RESHARD:
            tracker.reshard(event.unit)
        elif event.op is Op.GRADIENT and unit is not None:
            tracker.grads[event.unit] = unit.grad_bytes
        elif event.op is Op.REDUCE and unit is not None and not unit.reduced_on_completion:
            tracker.reduced[event.unit] = unit.issued_bytes
        elif event.op is Op.COMPLETE:
            tracker.complete(event.unit)
        tracker.observe(phase)
    return tracker.peak
