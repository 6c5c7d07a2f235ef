"""The state machine that drives every unit of one sharded model through forward and
backward: hooks, prefetching, the end-of-backward callback, full parameters on demand.
What happens when (prefetch, reshard, reduce) is decided by the step policy
(step_policy.py); the hooks carry it out:

    pre-forward   unshard the unit (or wait for its prefetch), show the unsharded views,
                  forward prefetch
    post-forward  reshard (every unit under no_grad); register the pre-backward hook on
                  the outputs
    pre-backward  unshard again if resharded; backward prefetch "pre"
    post-backward backward prefetch "post"; reduce the gradient (asynchronously, so it
                  overlaps the next unit's backward), reshard
    end of backward  reduce the units that got no gradient (every rank must take part),
                  agree on which parameters got a gradient anywhere (an all-reduce that
                  runs while the last reductions complete), accumulate into the sharded
                  gradients, reshard everything

A forward or backward that raised (caught by the user) is noticed when the next one starts,
and its leftovers are dropped: every unit back to sharded, so no later forward reads stale
gathered weights. A forward that no backward followed leaves units gathered (the root, the
last unit); the next forward gathers them afresh for the same reason.

While the torch profiler records, each hook runs in a region named `fsdpkit:<hook> <unit>`.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..dist.comm import Collectives
from .config import ShardingConfig
from .flat_unit import BackwardState, FlatUnit, PendingReduction, UnitState
from .memory import MemoryCounter
from .mesh import ShardMesh
from .step_policy import StepPolicy
from .wrapping import UnitSpec

STATE_ATTR = "_fsdpkit_state"


def _profiled(name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
    """`hook`, run inside a profiler region `name` while the torch profiler records (so
    traces, and benchmarks/step_breakdown.py, can tell engine work from model work)."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.autograd._profiler_enabled():
            return hook(*args, **kwargs)
        with record_function(name):
            return hook(*args, **kwargs)

    return run


class Phase(enum.Enum):
    """What the whole model is doing."""

    IDLE = "idle"  # between forwards and backwards
    FORWARD = "forward"  # inside the root's forward
    BACKWARD = "backward"  # a backward reached the model; its end-of-backward callback is queued
    SUMMONED = "summoned"  # full_params(): every unit holds its full master parameters


class GradientSync(enum.Enum):
    REDUCE = "reduce"  # every backward reduces the gradients
    ACCUMULATE = "accumulate"  # no_sync(): gradients stay unsharded and local


class RootRuntime:
    def __init__(
        self,
        module: nn.Module,
        specs: list[UnitSpec],
        mesh: ShardMesh,
        config: ShardingConfig,
        comms: Collectives,
        device: torch.device,
        *,
        record_events: bool = False,
    ) -> None:
        self.module = module
        self.mesh = mesh
        self.config = config
        self.policy = StepPolicy.of(config)
        self.comms = comms
        self.device = device
        self.memory = MemoryCounter()
        self.events: list[tuple[str, str]] | None = [] if record_events else None
        if record_events:
            comms.stats.events = self.events
        modules = dict(module.named_modules(remove_duplicate=False))
        gather_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.units: list[FlatUnit] = [
            FlatUnit(
                spec,
                modules,
                mesh,
                comms,
                config.mixed_precision,
                self.memory,
                device=device,
                offload=config.cpu_offload,
                gather_stream=gather_stream,
                gather_block=config.gather_block,
            )
            for spec in specs
        ]
        self.phase = Phase.IDLE
        self.gradient_sync = GradientSync.REDUCE
        self.backward_task = -1  # the autograd graph task whose end-of-backward callback is queued
        self.pending: list[PendingReduction] = []
        self.first_in_backward: FlatUnit | None = None  # the first non-root unit this backward prepared
        self.inflight_gathers: collections.deque[FlatUnit] = collections.deque()
        self.forward_order: list[FlatUnit] = []
        self.previous_forward_order: list[FlatUnit] = []
        self.has_root_unit = any(unit.is_root for unit in self.units)
        self.pre_backward_hooks: dict[FlatUnit | None, Callable[[torch.Tensor], None]] = {}
        self.handles = [module.register_forward_pre_hook(self._model_pre_forward)]
        for unit in self.units:
            for index, member in enumerate(unit.members):
                self.handles.append(member.register_forward_pre_hook(self._pre_forward_hook(unit), with_kwargs=True))
                last = index == len(unit.members) - 1
                self.handles.append(member.register_forward_hook(self._post_forward_hook(unit if last else None, unit)))
            if unit.trainable:
                self.handles.append(unit.full_flat.register_post_accumulate_grad_hook(self._post_backward_hook(unit)))
        self.handles.append(module.register_forward_hook(_profiled("fsdpkit:model_post_forward", self._model_post_forward)))

    def _record(self, kind: str, unit: FlatUnit | None) -> None:
        if self.events is not None:
            self.events.append((kind, unit.name if unit is not None else ""))

    # ----- prefetching
    def _start_gather(self, unit: FlatUnit | None) -> None:
        if unit is None or unit.is_gathered:
            return
        while self.policy.waits_before_gather(len(self.inflight_gathers)):
            self.inflight_gathers.popleft().wait_unshard()
        self._record("prefetch", unit)
        if unit.unshard(async_op=True) is not None:
            self.inflight_gathers.append(unit)

    def _ensure_unsharded(self, unit: FlatUnit) -> None:
        unit.unshard()
        unit.wait_unshard()
        if unit in self.inflight_gathers:
            self.inflight_gathers.remove(unit)

    def _next_in_backward(self, unit: FlatUnit) -> FlatUnit | None:
        return self.policy.next_in_backward(self.forward_order, unit, lambda u: u.backward is BackwardState.PENDING and u.trainable)

    def _needed_first_by_backward(self, unit: FlatUnit) -> bool:
        """The last unit of the previous forward: the first the backward needs, so
        resharding it after forward would only gather it again at once."""
        return bool(self.previous_forward_order) and self.previous_forward_order[-1] is unit

    def _next_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        return self.policy.next_in_forward(self.previous_forward_order, unit)

    # ----- hooks
    def _model_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.phase is Phase.SUMMONED:
            return
        if self.phase is Phase.FORWARD:  # the previous forward raised before it ended
            self._recover_from_failed_forward()
        self._recover_if_backward_failed()
        if self.phase is Phase.IDLE:
            self.phase = Phase.FORWARD
            # Units a forward with no backward after it left gathered (the root, the last
            # unit) hold the weights of that moment: gather them afresh.
            for unit in self.units:
                if unit.is_gathered:
                    self._free_full(unit)

    def _model_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE
        if not self.has_root_unit and self.phase is not Phase.SUMMONED and torch.is_grad_enabled():
            self._register_pre_backward(output, None)  # queues the end-of-backward callback

    def _pre_forward_hook(self, unit: FlatUnit):
        def pre_forward(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            if self.phase is Phase.SUMMONED:
                return args, kwargs
            self._recover_if_backward_failed()
            unit.release_cleared_grads()
            self._unshard_for_forward(unit)
            if unit.compute_dtype != unit.master_dtype:  # mixed precision: floating inputs in the unit's dtype
                args, kwargs = tree_map(
                    lambda t: t.to(unit.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, (args, kwargs)
                )
            if not unit.trainable and not unit.is_root and torch.is_grad_enabled():
                # No gradient of its own fires a post-backward hook: reshard once the
                # gradients of its inputs are computed for every use (its backward is then done).
                (args, kwargs), wrapped = _call_after_backward((args, kwargs), lambda: self._frozen_use_done(unit))
                unit.frozen_uses += wrapped
            return args, kwargs

        return _profiled(f"fsdpkit:pre_forward {unit.name or '<root>'}", pre_forward)

    def _frozen_use_done(self, unit: FlatUnit) -> None:
        unit.frozen_uses -= 1
        if unit.frozen_uses == 0:
            self._free_full(unit)

    def _unshard_for_forward(self, unit: FlatUnit) -> None:
        training = torch.is_grad_enabled()
        if training and unit not in self.forward_order:
            self.forward_order.append(unit)
        if unit.state is UnitState.UNSHARDED:
            return
        self._record("pre_forward", unit)
        self._ensure_unsharded(unit)
        unit.show_unsharded(track_grad=training)
        if training:
            self._start_gather(self._next_in_forward(unit))

    def _post_forward_hook(self, unit: FlatUnit | None, member_of: FlatUnit):
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if self.phase is Phase.SUMMONED:
                return output
            training = torch.is_grad_enabled()
            if unit is not None:
                self._record("post_forward", unit)
                if self.policy.reshards_after_forward(
                    is_root=unit.is_root, training=training, needed_first_by_backward=self._needed_first_by_backward(unit)
                ):
                    self._free_full(unit)
            if training:
                self._register_pre_backward(output, member_of)
            return output

        return _profiled(f"fsdpkit:post_forward {member_of.name or '<root>'}", post_forward)

    def _register_pre_backward(self, output: Any, unit: FlatUnit | None) -> None:
        hook = self.pre_backward_hooks.get(unit)
        if hook is None:
            hook = self.pre_backward_hooks[unit] = self._pre_backward_hook(unit)
        for tensor in tree_flatten(output)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(hook)

    def _pre_backward_hook(self, unit: FlatUnit | None):
        def pre_backward(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if self.phase is Phase.BACKWARD and task != self.backward_task:
                self._recover_from_failed_backward()
            if self.phase is not Phase.BACKWARD:
                self.phase = Phase.BACKWARD
                self.backward_task = task
                torch.autograd.Variable._execution_engine.queue_callback(_profiled("fsdpkit:end_of_backward", self._end_of_backward))
            if unit is None or unit.backward is not BackwardState.PENDING:
                return
            unit.backward = BackwardState.PREPARED
            self._record("pre_backward", unit)
            self._ensure_unsharded(unit)
            if self.policy.activation_checkpointing and unit.state is not UnitState.UNSHARDED:
                unit.show_unsharded(track_grad=True)  # recomputation reads the parameters again
            if self.first_in_backward is None and not unit.is_root:
                self.first_in_backward = unit
            if self.policy.prefetches_before_gradient(deferred=self._defers_prefetch(unit)):
                self._start_gather(self._next_in_backward(unit))

        return _profiled(f"fsdpkit:pre_backward {(unit.name or '<root>') if unit is not None else '<model>'}", pre_backward)

    def _post_backward_hook(self, unit: FlatUnit):
        def post_backward(full_flat: torch.Tensor) -> None:
            self._record("post_backward", unit)
            if self.policy.prefetches_after_gradient(deferred=self._defers_prefetch(unit)):
                self._start_gather(self._next_in_backward(unit))
            if self.gradient_sync is GradientSync.REDUCE:
                self._reduce(unit)
            else:
                unit.keep_grad_unsynced()
            self._free_full(unit)

        return _profiled(f"fsdpkit:post_backward {unit.name or '<root>'}", post_backward)

    def _free_full(self, unit: FlatUnit) -> None:
        if unit in self.inflight_gathers:
            self.inflight_gathers.remove(unit)
        unit.free_full()

    def _defers_prefetch(self, unit: FlatUnit) -> bool:
        return self.policy.defers_prefetch(first_in_backward=unit is self.first_in_backward, trainable=unit.trainable)

    def _reduce(self, unit: FlatUnit) -> None:
        # The new gradient exists now; complete earlier reductions (they ran while this
        # unit's backward computed), then start this one.
        grad = unit.take_grad()
        for pending in self.policy.reductions_to_complete(self.pending):
            pending.unit.complete_reduction(pending)
        self.pending.append(unit.issue_reduction(grad))

    def _end_of_backward(self) -> None:
        syncing = self.gradient_sync is GradientSync.REDUCE
        if syncing:
            for unit in self.units:
                if unit.trainable and unit.backward is not BackwardState.REDUCED:
                    self._reduce(unit)
            # Which parameters got a gradient on some rank: agreed on while the last
            # reductions complete.
            used = torch.tensor([flag for unit in self.units for flag in unit.used], dtype=torch.int32)
            flags_work = None
            if self.mesh.world_size > 1 and used.numel():
                used = used.to(self.device)  # NCCL reduces device tensors only
                flags_work = self.comms.all_reduce(used, self.mesh.group, op=dist.ReduceOp.MAX, async_op=True, label="grad-flags")
            for pending in self.pending:
                pending.unit.complete_reduction(pending)
            if flags_work is not None:
                flags_work.wait()
            used_of = dict(zip(map(id, self.units), torch.split(used.cpu(), [len(unit.params) for unit in self.units]), strict=True))
            for pending in self.pending:
                pending.unit.accumulate(pending, used_of[id(pending.unit)])
            self.pending.clear()
        for unit in self.units:
            self._free_full(unit)
            unit.end_backward(keep_usage=not syncing)
        self.previous_forward_order, self.forward_order = self.forward_order, []
        self.first_in_backward = None
        self.phase = Phase.IDLE

    # ----- recovery from a forward or backward that raised
    def _recover_if_backward_failed(self) -> None:
        if self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1:
            self._recover_from_failed_backward()

    def _recover_from_failed_backward(self) -> None:
        """A backward raised before its end: autograd dropped the queued callback. Drop its
        half-done work (every rank issued the same reductions, so waiting is safe) and
        return every unit to the sharded state, so training can go on."""
        for pending in self.pending:
            pending.unit.drop_reduction(pending)
        self.pending.clear()
        for unit in self.units:
            unit.drop_unsynced_grad()
            self._free_full(unit)
            unit.end_backward(keep_usage=False)
        self.inflight_gathers.clear()
        self.forward_order = []
        self.first_in_backward = None
        self.phase = Phase.IDLE

    def _recover_from_failed_forward(self) -> None:
        """A forward raised before its end: the units it gathered would otherwise keep the
        weights of that moment (stale once the optimizer steps). Gradients a backward
        already accumulated are kept."""
        for unit in self.units:
            self._free_full(unit)
            unit.frozen_uses = 0
        self.inflight_gathers.clear()
        self.phase = Phase.IDLE

    # ----- full parameters on demand
    @contextlib.contextmanager
    def full_params(self, *, writeback: bool = True) -> Iterator[None]:
        if self.phase is Phase.SUMMONED:
            raise RuntimeError("full_params() is already active for this model")
        self._recover_if_backward_failed()
        if self.phase is Phase.FORWARD:
            self._recover_from_failed_forward()
        if self.phase is Phase.BACKWARD:
            raise RuntimeError("full_params() cannot be used during backward")
        for unit in self.units:
            self._free_full(unit)
        buffers = []
        for unit in self.units:
            if unit.mesh.shard_factor == 1:
                full = unit.flat_shard
            else:
                full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=self.device)
                source = unit.flat_shard.to(self.device)
                self.comms.all_gather(full, source, unit.mesh.shard_group, label=f"full_params:{unit.name}")
            buffers.append(full)
            pieces = torch.split(full, unit.layout.split_sizes())
            unit._set_params(
                [
                    nn.Parameter(piece.view(spec.shape), requires_grad=spec.requires_grad)
                    for piece, spec in zip(pieces, unit.spec.params, strict=False)  # the last piece is the padding
                ]
            )
        self.phase = Phase.SUMMONED
        try:
            yield
        finally:
            self.phase = Phase.IDLE
            with torch.no_grad():
                for unit, full in zip(self.units, buffers, strict=True):
                    if writeback and full is not unit.flat_shard:
                        chunk = unit.layout.chunk_range(unit.mesh.shard_rank)
                        unit.flat_shard.copy_(full[chunk.start : chunk.end])
                    self._free_full(unit)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.gradient_sync = self.gradient_sync, GradientSync.ACCUMULATE
        try:
            yield
        finally:
            self.gradient_sync = previous


class _CallAfterBackward(torch.autograd.Function):
    """Identity on tensors; calls `callback` once when all their gradients are computed."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def _call_after_backward(inputs: Any, callback: Callable[[], None]) -> tuple[Any, bool]:
    """`inputs` with every tensor that requires grad routed through one _CallAfterBackward;
    False (and `inputs` unchanged) when none does, so `callback` will never run."""
    flat, spec = tree_flatten(inputs)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return inputs, False
    wrapped = _CallAfterBackward.apply(callback, *(flat[i] for i in positions))
    for position, tensor in zip(positions, wrapped, strict=True):
        flat[position] = tensor
    return tree_unflatten(flat, spec), True


def get_state(module: nn.Module) -> RootRuntime:
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(module).__name__} has not been sharded with fsdpkit.shard()")
    return state
