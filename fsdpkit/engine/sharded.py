"""The state machine that drives every unit of one sharded model through forward and
backward: hooks, the end-of-backward callback, and gathering full parameters on demand.

    pre-forward   unshard the unit, show the unsharded views
    post-forward  reshard (FULL_SHARD / HYBRID, non-root units; every unit under no_grad);
                  register the pre-backward hook on the outputs
    pre-backward  unshard again if resharded
    post-backward reduce-scatter the unit's gradient (asynchronously), reshard
    end of backward  reduce the units that got no gradient (every rank must take part),
                  agree on which parameters got a gradient anywhere, wait for every
                  reduction, accumulate into the sharded gradients, reshard everything
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..comm import Collectives
from .config import ShardingConfig
from .flat_unit import FlatUnit, PendingReduction
from .memory import MemoryCounter, tensor_bytes
from .mesh import ShardMesh
from .plan import UnitPlan

STATE_ATTR = "_fsdpkit_state"


class ShardedState:
    def __init__(self, module: nn.Module, plans: list[UnitPlan], mesh: ShardMesh, config: ShardingConfig, comms: Collectives, device: torch.device) -> None:
        self.module = module
        self.mesh = mesh
        self.config = config
        self.comms = comms
        self.device = device
        self.memory = MemoryCounter()
        modules = dict(module.named_modules(remove_duplicate=False))
        self.units = [
            FlatUnit(
                plan, modules, mesh, comms, config.mixed_precision, self.memory,
                is_root=plan.name == "",
                reshard_after_forward=config.reshard_after_forward,
                device=device,
            )
            for plan in plans
        ]
        self.pending: list[PendingReduction] = []
        self.callback_queued = False
        self.summoned = False
        self.handles = []
        for unit in self.units:
            owner = modules[unit.name]
            self.handles.append(owner.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self.handles.append(owner.register_forward_hook(self._post_forward_hook(unit)))
            if unit.trainable:
                self.handles.append(unit.full_flat.register_post_accumulate_grad_hook(self._post_backward_hook(unit)))
        if not any(unit.is_root for unit in self.units):
            self.handles.append(module.register_forward_hook(self._post_forward_hook(None)))

    # ----- hooks
    def _pre_forward_hook(self, unit: FlatUnit):
        def pre_forward(module: nn.Module, args: Any) -> None:
            if self.summoned:
                return
            unit.unshard()
            unit.show_unsharded(track_grad=torch.is_grad_enabled())

        return pre_forward

    def _post_forward_hook(self, unit: FlatUnit | None):
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if self.summoned:
                return output
            training = torch.is_grad_enabled()
            if unit is not None and (not training or unit.reshard_after_forward):
                unit.reshard()
            if training:
                for tensor in tree_flatten(output)[0]:
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(self._pre_backward_hook(unit))
            return output

        return post_forward

    def _pre_backward_hook(self, unit: FlatUnit | None):
        def pre_backward(grad: torch.Tensor) -> None:
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            if unit is not None and not unit.backward_prepared:
                unit.backward_prepared = True
                unit.unshard()

        return pre_backward

    def _post_backward_hook(self, unit: FlatUnit):
        def post_backward(full_flat: torch.Tensor) -> None:
            grad, full_flat.grad = full_flat.grad, None
            self._issue_reduction(unit, grad)
            unit.reshard()

        return post_backward

    def _issue_reduction(self, unit: FlatUnit, grad: torch.Tensor) -> None:
        pending = unit.issue_reduction(grad)
        self.memory.add("unsharded_grads", tensor_bytes(pending.source))
        self.pending.append(pending)

    def _end_of_backward(self) -> None:
        for unit in self.units:
            if unit.trainable and not unit.reduced_this_backward:
                zeros = torch.zeros(unit.layout.padded_numel, dtype=unit.reduce_dtype, device=self.device)
                self._issue_reduction(unit, zeros)
        used = torch.cat([unit.used for unit in self.units]) if self.units else torch.zeros(0, dtype=torch.int32)
        if self.mesh.world_size > 1 and used.numel():
            self.comms.all_reduce(used, self.mesh.group, op=dist.ReduceOp.MAX, label="grad-flags")
        offsets, start = {}, 0
        for unit in self.units:
            offsets[id(unit)] = used[start:start + len(unit.params)]
            start += len(unit.params)
        for pending in self.pending:
            pending.unit.finish_reduction(pending, offsets[id(pending.unit)])
            self.memory.add("unsharded_grads", -tensor_bytes(pending.source))
        self.pending.clear()
        for unit in self.units:
            unit.reshard()
            unit.reset_backward_state()
        self.callback_queued = False

    # ----- full parameters on demand
    @contextlib.contextmanager
    def full_params(self, *, writeback: bool = True) -> Iterator[None]:
        if self.summoned:
            raise RuntimeError("full_params() is already active for this model")
        if self.pending or self.callback_queued:
            raise RuntimeError("full_params() cannot be used during backward")
        for unit in self.units:
            unit.reshard()
        buffers = []
        for unit in self.units:
            if unit.mesh.shard_factor == 1:
                full = unit.flat_shard
            else:
                full = torch.empty(unit.layout.padded_numel, dtype=unit.master_dtype, device=self.device)
                self.comms.all_gather(full, unit.flat_shard, unit.mesh.shard_group, label=f"full_params:{unit.name}")
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
                    unit.reshard()


def get_state(module: nn.Module) -> ShardedState:
    state = getattr(module, STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(module).__name__} has not been sharded with fsdpkit.shard()")
    return state
