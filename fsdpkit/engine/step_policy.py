"""The order in which one training step gathers, computes, reshards and reduces each unit:
one policy that the engine's hooks follow (sharded.py), that the memory plan replays
(memory_timeline.py) and that the step-time model simulates (step_time.py). Pure: no
tensors, no process group.

Units run forward in wrapping order (the root first: its pre-forward hook fires before any
block's) and backward in reverse, the root last. Per unit:

    forward   gather (or wait for its prefetch); with forward prefetch, issue the next
              unit's all-gather (the previous forward's order) before computing; after
              the forward, reshard when the strategy reshards after forward, unless the
              unit is the root or the one the forward ended with (backward needs it first)
    backward  gather again if resharded (checkpointing recomputes the forward now);
              backward prefetch "pre" issues the next unit's all-gather before the
              gradient is computed, "post" after it; the first unit of the backward
              defers a "pre" prefetch until its gradient exists (its backward runs at the
              activation peak, which one more gathered unit would raise); the gradient
              appears, the earlier reductions complete (at most `pending_reductions`
              stay in flight) and its own is issued; reshard
    end       every reduction completes (an all-reduce agrees which parameters got a
              gradient on some rank); every unit reshards

The all-gather limiter waits for the oldest gather in flight before issuing one more than
`limit_all_gathers`. Under no_sync a backward keeps its gradients unsharded and reduces
nothing. With CPU offload the shard is copied to the device before its all-gather and the
reduced gradient back to the host when its reduction completes.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .config import BackwardPrefetch, ShardingConfig

T = TypeVar("T")

# The engine completes every earlier reduction when a new gradient arrives.
ENGINE_PENDING_REDUCTIONS = 1


@dataclass(frozen=True)
class StepPolicy:
    reshard_after_forward: bool = True
    forward_prefetch: bool = False
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
    limit_all_gathers: int = 2  # 0: no limit
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    pending_reductions: int | None = ENGINE_PENDING_REDUCTIONS  # None: every reduction waits for the end of backward

    def __post_init__(self) -> None:
        object.__setattr__(self, "backward_prefetch", BackwardPrefetch(self.backward_prefetch))
        if self.pending_reductions is not None and self.pending_reductions < 1:
            raise ValueError(f"pending_reductions must be >= 1 or None, got {self.pending_reductions}")

    @classmethod
    def of(cls, config: ShardingConfig) -> StepPolicy:
        return cls(
            reshard_after_forward=config.reshard_after_forward,
            forward_prefetch=config.forward_prefetch,
            backward_prefetch=config.backward_prefetch,
            limit_all_gathers=config.limit_all_gathers,
            activation_checkpointing=config.activation_checkpointing,
            cpu_offload=config.cpu_offload,
        )

    # ----- forward
    def reshards_after_forward(self, *, is_root: bool, training: bool, needed_first_by_backward: bool) -> bool:
        if not training:
            return True
        return self.reshard_after_forward and not is_root and not needed_first_by_backward

    def next_in_forward(self, previous_order: Sequence[T], unit: T) -> T | None:
        """The unit to prefetch before `unit` computes its forward (None without forward prefetch)."""
        if not self.forward_prefetch or unit not in previous_order:
            return None
        index = list(previous_order).index(unit)
        return previous_order[index + 1] if index + 1 < len(previous_order) else None

    # ----- backward
    def next_in_backward(self, forward_order: Sequence[T], unit: T, waiting: Callable[[T], bool]) -> T | None:
        """The unit the backward needs after `unit`: the next in reverse forward order (then
        wrapping around) that still `waiting` for its gradient."""
        order = list(forward_order)[::-1]
        if unit not in order:
            return None
        after = order[order.index(unit) + 1 :] + order
        return next((u for u in after if u is not unit and waiting(u)), None)

    def defers_prefetch(self, *, first_in_backward: bool, trainable: bool) -> bool:
        return self.backward_prefetch is BackwardPrefetch.PRE and first_in_backward and trainable and not self.activation_checkpointing

    def prefetches_before_gradient(self, *, deferred: bool) -> bool:
        return self.backward_prefetch is BackwardPrefetch.PRE and not deferred

    def prefetches_after_gradient(self, *, deferred: bool) -> bool:
        return self.backward_prefetch is BackwardPrefetch.POST or deferred

    def waits_before_gather(self, in_flight: int) -> bool:
        """The limiter: wait for the oldest all-gather in flight before issuing another."""
        return bool(self.limit_all_gathers) and in_flight >= self.limit_all_gathers

    def reductions_to_complete(self, issued: Sequence[T]) -> Sequence[T]:
        """Of the reductions issued so far (oldest first), those to complete before issuing
        the next: all but the newest pending_reductions - 1."""
        if self.pending_reductions is None:
            return ()
        keep = self.pending_reductions - 1
        return issued[: max(len(issued) - keep, 0)]


class Op(enum.Enum):
    GATHER = "gather"  # issue the unit's all-gather (its own, or a prefetch)
    WAIT = "wait"  # the compute stream waits for the unit's all-gather
    FORWARD = "forward"  # the unit computes its forward
    RESHARD = "reshard"  # the unsharded parameters are freed
    BACKWARD = "backward"  # the unit computes its gradient (and recomputes its forward under checkpointing)
    GRADIENT = "gradient"  # the full gradient exists
    REDUCE = "reduce"  # issue the gradient's reduction
    COMPLETE = "complete"  # wait for a reduction; the sharded gradient lands
    END = "end"  # end of backward: the used-parameter flags are agreed on while the last reductions complete


@dataclass(frozen=True)
class Event:
    op: Op
    unit: str = ""


def step_events(units: Sequence[tuple[str, bool]], policy: StepPolicy, *, reduce: bool = True) -> list[Event]:
    """One forward and backward of units (name, trainable), the root first, in the order the
    engine runs them (steady state: the previous forward's order is known). `reduce=False`:
    a backward under no_sync."""
    if not units:
        return []
    trainable = dict(units)
    root, blocks = units[0][0], [name for name, _ in units[1:]]
    events: list[Event] = []
    held: set[str] = set()

    def gather(name: str | None) -> None:
        if name is not None and name not in held:
            held.add(name)
            events.append(Event(Op.GATHER, name))

    def use(name: str) -> None:
        gather(name)
        events.append(Event(Op.WAIT, name))

    forward_order = [root, *blocks]
    for index, name in enumerate(forward_order):
        use(name)
        gather(policy.next_in_forward(forward_order, name))
        events.append(Event(Op.FORWARD, name))
        last = index == len(forward_order) - 1
        if policy.reshards_after_forward(is_root=name == root, training=True, needed_first_by_backward=last):
            held.discard(name)
            events.append(Event(Op.RESHARD, name))
    issued: list[str] = []
    done: set[str] = set()
    for index, name in enumerate([*reversed(blocks), root]):
        use(name)
        done.add(name)
        deferred = policy.defers_prefetch(first_in_backward=index == 0 and name != root, trainable=trainable[name])
        following = policy.next_in_backward(forward_order, name, lambda u: u not in done and trainable[u])
        if policy.prefetches_before_gradient(deferred=deferred):
            gather(following)
        events.append(Event(Op.BACKWARD, name))
        if trainable[name]:
            events.append(Event(Op.GRADIENT, name))
            if policy.prefetches_after_gradient(deferred=deferred):
                gather(following)
            if reduce:
                completing = policy.reductions_to_complete(issued)
                events += [Event(Op.COMPLETE, earlier) for earlier in completing]
                issued = [*issued[len(completing) :], name]
                events.append(Event(Op.REDUCE, name))
        if name != root:
            held.discard(name)
            events.append(Event(Op.RESHARD, name))
    events.append(Event(Op.END))
    events += [Event(Op.COMPLETE, name) for name in issued]
    events.append(Event(Op.RESHARD, root))
    return events
