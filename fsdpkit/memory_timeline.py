"""The unsharded bytes in flight during one training step, by replaying the engine's
schedule on numbers only (no tensors, no process group).

Units run forward in plan order (the root first: its pre-forward hook fires before any
block's) and backward in reverse, the root last (its parameters, e.g. a tied embedding,
get their gradient when backward reaches the model's input). Per unit:

    forward   unshard (+param); with forward prefetch the next unit is gathered before
              this one computes; post-forward: reshard (-param) when the strategy
              reshards after forward and the unit is neither the root nor the last one
              (backward needs that one first, so the engine keeps it)
    backward  unshard again if resharded; with backward prefetch (pre or post) the next
              unit in backward order is gathered while this one's gradient exists (the
              first unit of the backward gathers the next only once its own gradient is
              done: its backward runs at the activation peak); the full gradient appears
              (+grad) and its reduction is issued; reshard (-param)
    end       every pending reduction completes (-grad); the root reshards

Prefetching looks one unit ahead, so at most two non-root units hold parameters at once;
the engine's rate limiter (--limit-all-gathers) bounds all-gathers issued but not yet
waited on, which a one-ahead prefetch never exceeds, so it changes no byte here. A gradient stays until its reduction completes:
`pending_reductions=None` holds every one to the end of backward (the engine waits for
them there); an int N frees the oldest when an (N+1)-th is issued.
"""

from __future__ import annotations

from dataclasses import dataclass


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
class Schedule:
    reshard_after_forward: bool = True
    forward_prefetch: bool = False
    backward_prefetch: bool = True
    pending_reductions: int | None = None

    def __post_init__(self) -> None:
        if self.pending_reductions is not None and self.pending_reductions < 1:
            raise ValueError(f"pending_reductions must be >= 1 or None, got {self.pending_reductions}")


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


def peak_unsharded(units: list[UnitFootprint], schedule: Schedule) -> Peak:
    """The largest sum of unsharded parameters and gradients held at any point of a step,
    with the sharded gradients produced so far (the engine frees them when the optimizer
    clears .grad, and rebuilds them during backward).

    `units[0]` is the root; the rest are in forward order.
    """
    if not units:
        return Peak(0, (), (), "forward")
    tracker = _Tracker(units)
    root, blocks = units[0].name, [unit.name for unit in units[1:]]

    def prefetch(candidates: list[str]) -> None:
        if candidates:
            tracker.unshard(candidates[0])

    tracker.unshard(root)
    tracker.observe("forward")
    for index, name in enumerate(blocks):
        tracker.unshard(name)
        if schedule.forward_prefetch:
            prefetch(blocks[index + 1 :])
        tracker.observe("forward")
        if schedule.reshard_after_forward and index < len(blocks) - 1:
            tracker.reshard(name)

    pending: list[str] = []
    backward_order = list(reversed(blocks)) + [root]
    for index, name in enumerate(backward_order):
        tracker.unshard(name)
        following = [n for n in backward_order[index + 1 :] if n != root]
        deferred = index == 0 and name != root and tracker.units[name].trainable
        if schedule.backward_prefetch and not deferred:
            prefetch(following)
        tracker.observe("backward")
        if tracker.units[name].trainable:
            # the engine's order: the gradient arrives, earlier reductions complete, this one starts
            tracker.grads[name] = tracker.units[name].grad_bytes
            if schedule.backward_prefetch and deferred:
                prefetch(following)
            tracker.observe("backward")
            pending.append(name)
            while schedule.pending_reductions is not None and len(pending) > schedule.pending_reductions:
                tracker.complete(pending.pop(0))
            if not tracker.units[name].reduced_on_completion:
                tracker.reduced[name] = tracker.units[name].issued_bytes
            tracker.observe("backward")
        if name != root:
            tracker.reshard(name)
    for name in pending:  # the end of backward waits for the rest
        tracker.complete(name)
    tracker.observe("backward")
    return tracker.peak
