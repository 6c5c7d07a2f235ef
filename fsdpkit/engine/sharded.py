"""The state machine that drives every unit of one sharded model through forward and
backward: hooks, prefetching, the end-of-backward callback, full parameters on demand.

    pre-forward   unshard the unit (or wait for its prefetch), show the unsharded views;
                  forward prefetch: start the next unit's all-gather (previous iteration's order)
    post-forward  reshard (FULL_SHARD / HYBRID non-root units; every unit under no_grad);
                  register the pre-backward hook on the outputs
    pre-backward  unshard again if resharded; backward prefetch "pre": start the next
                  unit's all-gather before this unit's gradients are computed
    post-backward backward prefetch "post"; reduce-scatter the gradient (asynchronously,
                  so it overlaps the next unit's backward), reshard
    end of backward  reduce the units that got no gradient (every rank must take part),
                  agree on which parameters got a gradient anywhere, wait for every
                  reduction, accumulate into the sharded gradients, reshard everything
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..comm import Collectives
from .config import ShardingConfig
from .flat_unit import FlatUnit
from .memory import MemoryCounter, tensor_bytes
from .mesh import ShardMesh
from .plan import UnitPlan

STATE_ATTR = "_fsdpkit_state"


class ShardedState:
    def __init__(self, module: nn.Module, plans: list[UnitPlan], mesh: ShardMesh, config: ShardingConfig,
                 comms: Collectives, device: torch.device, *, materialize=None, record_events: bool = False) -> None:
        self.module = module
        self.mesh = mesh
        self.config = config
        self.comms = comms
        self.device = device
        self.memory = MemoryCounter()
        self.events: list[tuple[str, str]] | None = [] if record_events else None
        if record_events:
            comms.stats.events = self.events
        modules = dict(module.named_modules(remove_duplicate=False))
        gather_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.units: list[FlatUnit] = []
        for plan in plans:
            if materialize is not None:
                materialize(plan)
            self.units.append(FlatUnit(
                plan, modules, mesh, comms, config.mixed_precision, self.memory,
                reshard_after_forward=config.reshard_after_forward, device=device, offload=config.cpu_offload,
                gather_stream=gather_stream,
            ))
        self.pending = []
        self.inflight_gathers: collections.deque[FlatUnit] = collections.deque()
        self.forward_order: list[FlatUnit] = []
        self.previous_forward_order: list[FlatUnit] = []
        self.callback_queued = False
        self.backward_task = -1  # the autograd graph task whose end-of-backward callback is queued
        self.summoned = False
        self.sync_gradients = True
        self.handles = []
        for unit in self.units:
            for index, member in enumerate(unit.members):
                self.handles.append(member.register_forward_pre_hook(self._pre_forward_hook(unit)))
                last = index == len(unit.members) - 1
                self.handles.append(member.register_forward_hook(self._post_forward_hook(unit if last else None, unit)))
            if unit.trainable:
                self.handles.append(unit.full_flat.register_post_accumulate_grad_hook(self._post_backward_hook(unit)))
        if not any(unit.is_root for unit in self.units):
            self.handles.append(module.register_forward_hook(self._post_forward_hook(None, None)))

    def _record(self, kind: str, unit: FlatUnit | None) -> None:
        if self.events is not None:
            self.events.append((kind, unit.name if unit is not None else ""))

    # ----- prefetching
    def _start_gather(self, unit: FlatUnit | None) -> None:
        if unit is None or unit.is_unsharded:
            return
        limit = self.config.limit_all_gathers
        while limit and len(self.inflight_gathers) >= limit:
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
        order = self.forward_order[::-1]
        if unit not in order:
            return None
        waiting = [u for u in order[order.index(unit) + 1:] + order if u is not unit and not u.backward_prepared and u.trainable]
        return waiting[0] if waiting else None

    def _next_in_forward(self, unit: FlatUnit) -> FlatUnit | None:
        order = self.previous_forward_order
        if unit in order and order.index(unit) + 1 < len(order):
            return order[order.index(unit) + 1]
        return None

    # ----- hooks
    def _pre_forward_hook(self, unit: FlatUnit):
        def pre_forward(module: nn.Module, args: Any) -> Any:
            if self.summoned:
                return None
            if self.callback_queued and torch._C._current_graph_task_id() == -1:
                self._recover_from_failed_backward()
            unit.release_cleared_grads()
            self._unshard_for_forward(unit)
            if unit.compute_dtype != unit.master_dtype:  # mixed precision: floating inputs in the unit's dtype
                args = tree_map(lambda t: t.to(unit.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)
            if not unit.trainable and not unit.is_root and torch.is_grad_enabled():
                # No gradient of its own fires a post-backward hook: reshard once the
                # gradients of its inputs are computed (its backward is then done).
                args = _after_backward_of_inputs(args, lambda: self._reshard(unit))
            return args

        return pre_forward

    def _unshard_for_forward(self, unit: FlatUnit) -> None:
        training = torch.is_grad_enabled()
        if training and unit not in self.forward_order:
            self.forward_order.append(unit)
        if unit.is_unsharded and unit.views_shown:
            return
        self._record("pre_forward", unit)
        self._ensure_unsharded(unit)
        unit.show_unsharded(track_grad=training)
        unit.views_shown = True
        if training and self.config.forward_prefetch:
            self._start_gather(self._next_in_forward(unit))

    def _post_forward_hook(self, unit: FlatUnit | None, member_of: FlatUnit | None):
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if self.summoned:
                return output
            training = torch.is_grad_enabled()
            if unit is not None:
                self._record("post_forward", unit)
                if not training or unit.reshard_after_forward:
                    self._reshard(unit)
            if training:
                for tensor in tree_flatten(output)[0]:
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(self._pre_backward_hook(member_of))
            return output

        return post_forward

    def _pre_backward_hook(self, unit: FlatUnit | None):
        def pre_backward(grad: torch.Tensor) -> None:
            task = torch._C._current_graph_task_id()
            if self.callback_queued and task != self.backward_task:
                self._recover_from_failed_backward()
            if not self.callback_queued:
                self.callback_queued = True
                self.backward_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if unit is None or unit.backward_prepared:
                return
            unit.backward_prepared = True
            self._record("pre_backward", unit)
            self._ensure_unsharded(unit)
            if self.config.activation_checkpointing and not unit.views_shown:
                unit.show_unsharded(track_grad=True)  # recomputation reads the parameters again
                unit.views_shown = True
            if self.config.backward_prefetch == "pre":
                self._start_gather(self._next_in_backward(unit))

        return pre_backward

    def _post_backward_hook(self, unit: FlatUnit):
        def post_backward(full_flat: torch.Tensor) -> None:
            self._record("post_backward", unit)
            if self.config.backward_prefetch == "post":
                self._start_gather(self._next_in_backward(unit))
            if self.sync_gradients:
                grad, full_flat.grad = full_flat.grad, None
                if unit.holds_unsynced_grad:
                    self.memory.add("unsharded_grads", -tensor_bytes(grad))
                    unit.holds_unsynced_grad = False
                self._issue_reduction(unit, grad)
            elif not unit.holds_unsynced_grad:
                unit.holds_unsynced_grad = True
                self.memory.add("unsharded_grads", tensor_bytes(full_flat.grad))
            unit.backward_done = True
            self._reshard(unit)

        return post_backward

    def _reshard(self, unit: FlatUnit) -> None:
        if unit in self.inflight_gathers:
            self.inflight_gathers.remove(unit)
        unit.reshard()
        unit.views_shown = False

    def _issue_reduction(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        # The new gradient exists now; complete the earlier reductions (they ran while this
        # unit's backward computed), so at most one full gradient waits on the network at a
        # time, as in torch FSDP; then start this one.
        self.memory.add("unsharded_grads", tensor_bytes(grad))
        self._complete_pending()
        pending = unit.issue_reduction(grad)
        if pending.output is not pending.source:
            self.memory.add("sharded_grads", tensor_bytes(pending.output))  # the reduce-scatter's output chunk
        self.pending.append(pending)

    def _complete_pending(self) -> None:
        for pending in self.pending:
            if pending.source is not None:
                source_bytes = tensor_bytes(pending.source)
                output_bytes = 0 if pending.output is pending.source else tensor_bytes(pending.output)
                pending.unit.complete_reduction(pending)
                self.memory.add("unsharded_grads", -source_bytes)
                self.memory.add("sharded_grads", tensor_bytes(pending.output) - output_bytes)

    def _end_of_backward(self) -> None:
        if self.sync_gradients:
            for unit in self.units:
                if unit.trainable and not unit.reduced_this_backward:
                    grad, unit.full_flat.grad = unit.full_flat.grad, None
                    if grad is None:
                        grad = torch.zeros(unit.layout.padded_numel, dtype=unit.compute_dtype, device=self.device)
                    elif unit.holds_unsynced_grad:
                        self.memory.add("unsharded_grads", -tensor_bytes(grad))
                        unit.holds_unsynced_grad = False
                    self._issue_reduction(unit, grad)
            used = torch.cat([unit.used for unit in self.units]) if self.units else torch.zeros(0, dtype=torch.int32)
            if self.mesh.world_size > 1 and used.numel():
                flags = used.to(self.device)  # NCCL reduces device tensors only
                self.comms.all_reduce(flags, self.mesh.group, op=dist.ReduceOp.MAX, label="grad-flags")
                used = flags.cpu()
            start = 0
            used_of = {}
            for unit in self.units:
                used_of[id(unit)] = used[start:start + len(unit.params)]
                start += len(unit.params)
            self._complete_pending()
            for pending in self.pending:
                pending.unit.accumulate(pending, used_of[id(pending.unit)])
            self.pending.clear()
        for unit in self.units:
            self._reshard(unit)
            unit.reset_backward_state(keep_usage=not self.sync_gradients)
        self.previous_forward_order, self.forward_order = self.forward_order, []
        self.callback_queued = False

    def _recover_from_failed_backward(self) -> None:
        """A backward raised before its end: autograd dropped the queued callback. Drop its
        half-done work (every rank issued the same reductions, so waiting is safe) and
        return every unit to the sharded state, so training can go on."""
        for pending in self.pending:
            if pending.work is not None:
                pending.work.wait()
            if pending.source is not None:
                self.memory.add("unsharded_grads", -tensor_bytes(pending.source))
            if pending.output is not pending.source:
                self.memory.add("sharded_grads", -tensor_bytes(pending.output))
        self.pending.clear()
        for unit in self.units:
            if unit.holds_unsynced_grad and unit.full_flat.grad is not None:
                self.memory.add("unsharded_grads", -tensor_bytes(unit.full_flat.grad))
            unit.full_flat.grad = None
            unit.holds_unsynced_grad = False
            self._reshard(unit)
            unit.reset_backward_state(keep_usage=False)
        self.inflight_gathers.clear()
        self.forward_order = []
        self.callback_queued = False

    # ----- full parameters on demand
    @contextlib.contextmanager
    def full_params(self, *, writeback: bool = True) -> Iterator[None]:
        if self.summoned:
            raise RuntimeError("full_params() is already active for this model")
        if self.callback_queued and torch._C._current_graph_task_id() == -1:
            self._recover_from_failed_backward()
        if self.pending or self.callback_queued:
            raise RuntimeError("full_params() cannot be used during backward")
        for unit in self.units:
            self._reshard(unit)
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
            unit._set_params([
                nn.Parameter(piece.view(plan.shape), requires_grad=plan.requires_grad)
                for piece, plan in zip(pieces, unit.plan.params)
            ])
        self.summoned = True
        try:
            yield
        finally:
            self.summoned = False
            with torch.no_grad():
                for unit, full in zip(self.units, buffers):
                    if writeback and full is not unit.flat_shard:
                        chunk = unit.layout.chunk_range(unit.mesh.shard_rank)
                        unit.flat_shard.copy_(full[chunk.start:chunk.end])
                    self._reshard(unit)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = previous


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


def _after_backward_of_inputs(args: Any, callback) -> Any:
    flat, spec = tree_flatten(args)
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return args
    wrapped = _CallAfterBackward.apply(callback, *(flat[i] for i in positions))
    for position, tensor in zip(positions, wrapped):
        flat[position] = tensor
    return spec.unflatten(flat) if hasattr(spec, "unflatten") else tree_unflatten(flat, spec)


def get_state(module: nn.Module) -> ShardedState:
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(module).__name__} has not been sharded with fsdpkit.shard()")
    return state
