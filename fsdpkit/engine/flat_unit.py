"""One unit's FlatParameter: the sharded master chunk, the unsharded buffer the unit computes
with, and the reduction of its gradient back into the chunk.

Sharded state: each original parameter is an nn.Parameter that is a 1-D view of its own
fragment of `flat_shard` (possibly empty); the optimizer updates those views in place.
Unsharded state: `full_flat` (a leaf that autograd accumulates into) holds the whole padded
flat parameter in the compute dtype, and each original parameter is a view of it with its
original shape.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..comm import Collectives
from ..layout import FlatLayout
from .config import MixedPrecision
from .memory import MemoryCounter, tensor_bytes
from .mesh import ShardMesh
from .plan import UnitPlan

SHAPE_ATTR = "_fsdpkit_shape"
NAME_ATTR = "_fsdpkit_name"


@dataclass
class PendingReduction:
    unit: "FlatUnit"
    output: torch.Tensor
    source: torch.Tensor | None  # the full gradient, kept alive until the collective completes
    work: Any


class FlatUnit:
    def __init__(
        self,
        plan: UnitPlan,
        modules: dict[str, nn.Module],
        mesh: ShardMesh,
        comms: Collectives,
        mixed_precision: MixedPrecision,
        memory: MemoryCounter,
        *,
        reshard_after_forward: bool,
        device: torch.device,
        offload: bool = False,
        gather_stream: "torch.cuda.Stream | None" = None,
    ) -> None:
        self.name = plan.name
        self.plan = plan
        self.mesh = mesh
        self.comms = comms
        self.memory = memory
        self.is_root = plan.members == ("",)
        self.reshard_after_forward = reshard_after_forward and not self.is_root
        self.members = [modules[name] for name in plan.members]
        self.layout: FlatLayout = plan.layout(mesh.shard_factor)
        self.fragments = self.layout.fragments(mesh.shard_rank)
        self.uses = [[(modules[m], attr) for m, attr in p.uses] for p in plan.params]
        originals = [getattr(uses[0][0], uses[0][1]) for uses in self.uses]
        dtypes = {t.dtype for t in originals}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(f"unit {self.name or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; one floating dtype per unit is required")
        self.master_dtype = dtypes.pop()
        self.compute_dtype = mixed_precision.param_dtype or self.master_dtype
        self.reduce_dtype = mixed_precision.reduce_dtype or self.compute_dtype
        self.device = device
        self.offload = offload
        self.host = torch.device("cpu") if offload else device
        self.gather_stream = gather_stream

        self.flat_shard = torch.zeros(self.layout.chunk_numel, dtype=self.master_dtype, device=self.host)
        with torch.no_grad():
            for fragment, original in zip(self.fragments, originals):
                source = original.detach().reshape(-1)[fragment.param_range.start:fragment.param_range.end]
                self._local(self.flat_shard, fragment).copy_(source)
        self.params: list[nn.Parameter] = []
        for fragment, param_plan in zip(self.fragments, plan.params):
            param = nn.Parameter(self._local(self.flat_shard, fragment), requires_grad=param_plan.requires_grad)
            setattr(param, SHAPE_ATTR, torch.Size(param_plan.shape))
            setattr(param, NAME_ATTR, param_plan.name)
            self.params.append(param)
        self.trainable = any(p.requires_grad for p in self.params)
        self.grad_shard: torch.Tensor | None = None
        memory.add("sharded_params", tensor_bytes(self.flat_shard))

        self.aliases_shard = mesh.shard_factor == 1 and self.compute_dtype == self.master_dtype and not offload
        if self.aliases_shard:
            self.full_flat = self.flat_shard.detach()
        else:
            self.full_flat = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype, device=device)
            self.full_flat.untyped_storage().resize_(0)
        self.full_flat.requires_grad_(self.trainable)
        self.is_unsharded = False
        self.gather_work: Any = None
        self.views_shown = False
        self.used = torch.zeros(len(self.params), dtype=torch.int32)
        self.holds_unsynced_grad = False
        self.reset_backward_state(keep_usage=False)
        self._set_params(self.params)

    # ----- layout helpers
    @staticmethod
    def _local(flat: torch.Tensor, fragment) -> torch.Tensor:
        return flat[fragment.local_offset:fragment.local_offset + fragment.param_range.size]

    def _set_params(self, tensors: list[torch.Tensor]) -> None:
        for uses, tensor in zip(self.uses, tensors):
            for module, attr in uses:
                module._parameters[attr] = tensor

    def reset_backward_state(self, *, keep_usage: bool) -> None:
        self.backward_prepared = False
        self.backward_done = False
        self.reduced_this_backward = False
        if not keep_usage:
            self.used.zero_()

    # ----- unshard / reshard
    def unshard(self, *, async_op: bool = False) -> Any:
        """Start (or do) the all-gather of the unit into `full_flat` in the compute dtype.

        Returns the work handle when asynchronous; `wait_unshard()` before using the data.
        """
        if self.is_unsharded:
            return None
        self.is_unsharded = True
        if self.aliases_shard:
            return None
        full = self.full_flat
        if full.untyped_storage().size() == 0:
            full.untyped_storage().resize_(self.layout.padded_numel * full.element_size())
            self.memory.add("unsharded_params", tensor_bytes(full))
        # On CUDA a prefetch runs on its own stream (the paper's section 3.3: issued from the
        # compute stream, NCCL would wait for compute queued before it); wait() joins it back.
        on_side_stream = async_op and self.gather_stream is not None and self.mesh.shard_factor > 1
        compute_stream = torch.cuda.current_stream(self.device) if on_side_stream else None
        with torch.cuda.stream(self.gather_stream) if on_side_stream else contextlib.nullcontext():
            if on_side_stream:
                self.gather_stream.wait_stream(compute_stream)  # the optimizer may have just updated the shard
            source = self.flat_shard.to(device=self.device, dtype=self.compute_dtype, non_blocking=True)
            # `.data`: fills the buffer without bumping the version counter autograd checks on saved views.
            if self.mesh.shard_factor > 1:
                self.gather_work = self.comms.all_gather(full.data, source, self.mesh.shard_group, async_op=async_op, label=self.name)
                if not async_op:
                    self.gather_work = None
            else:
                full.data.copy_(source)
        return self.gather_work

    def wait_unshard(self) -> None:
        if self.gather_work is not None:
            work, self.gather_work = self.gather_work, None
            work.wait()

    def show_unsharded(self, *, track_grad: bool) -> None:
        """Point every original parameter at its view of `full_flat`, with its own shape."""
        self.wait_unshard()
        base = self.full_flat if (track_grad and self.trainable) else self.full_flat.detach()
        pieces = torch.split(base, self.layout.split_sizes())
        views = [
            (piece if param_plan.requires_grad else piece.detach()).view(param_plan.shape)
            for piece, param_plan in zip(pieces, self.plan.params)
        ]
        if base.requires_grad:
            for index, view in enumerate(views):
                if view.requires_grad:
                    view.register_hook(self._usage_hook(index))
        self._set_params(views)

    def _usage_hook(self, index: int):
        def mark_used(grad: torch.Tensor) -> None:
            self.used[index] = 1

        return mark_used

    def reshard(self) -> None:
        """Back to the sharded state: original names show the fragments; free the full buffer."""
        self._set_params(self.params)
        if not self.is_unsharded:
            return
        self.wait_unshard()
        self.is_unsharded = False
        if not self.aliases_shard and self.full_flat.untyped_storage().size():
            self.full_flat.untyped_storage().resize_(0)
            self.memory.add("unsharded_params", -tensor_bytes(self.full_flat))

    def release_cleared_grads(self) -> None:
        """Free the sharded gradient once the optimizer cleared every .grad (zero_grad with
        set_to_none), so it is not held through the next forward and backward."""
        if self.grad_shard is not None and all(param.grad is None for param in self.params):
            self.memory.add("sharded_grads", -tensor_bytes(self.grad_shard))
            self.grad_shard = None

    # ----- gradient reduction
    def issue_reduction(self, full_grad: torch.Tensor) -> PendingReduction:
        """Start reducing a full padded gradient: reduce-scatter in the shard group (or
        all-reduce across replicas when F = 1)."""
        grad = full_grad if full_grad.dtype == self.reduce_dtype else full_grad.to(self.reduce_dtype)
        if self.mesh.shard_factor > 1:
            output = torch.empty(self.layout.chunk_numel, dtype=self.reduce_dtype, device=self.device)
            work = self.comms.reduce_scatter(output, grad, self.mesh.shard_group, async_op=True, label=self.name)
        else:
            output = grad
            work = None
            if self.mesh.replicate_group is not None:
                work = self.comms.all_reduce(output, self.mesh.replicate_group, async_op=True, label=self.name)
        self.reduced_this_backward = True
        return PendingReduction(self, output, full_grad, work)

    def complete_reduction(self, pending: PendingReduction) -> None:
        """Wait for the reduction, all-reduce across replicas (hybrid) and average; the full
        gradient it read from is released (pending.source = None)."""
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        reduced = pending.output
        if self.mesh.shard_factor > 1 and self.mesh.replicate_group is not None:
            self.comms.all_reduce(reduced, self.mesh.replicate_group, label=self.name)
        pending.output = reduced.to(device=self.host, dtype=self.master_dtype).div_(self.mesh.world_size)
        pending.source = None

    def accumulate(self, pending: PendingReduction, used: torch.Tensor) -> None:
        """Add a completed reduction into the sharded gradient of every parameter that some
        rank gave a gradient (the others keep grad None, as an unused parameter should)."""
        reduced = pending.output
        if self.grad_shard is None:
            # The reduction's output becomes the sharded gradient: no copy, no second buffer
            # (the memory counter already holds it since the reduction was issued).
            self.grad_shard = reduced
            for index, (fragment, param) in enumerate(zip(self.fragments, self.params)):
                if param.requires_grad and used[index]:
                    param.grad = self._local(self.grad_shard, fragment)
            return
        self.memory.add("sharded_grads", -tensor_bytes(reduced))  # added into grad_shard, then dropped
        for index, (fragment, param) in enumerate(zip(self.fragments, self.params)):
            if not param.requires_grad or not used[index]:
                continue
            target = self._local(self.grad_shard, fragment)
            piece = self._local(reduced, fragment)
            if param.grad is None:
                target.copy_(piece)
            else:
                if target.numel() and param.grad.data_ptr() != target.data_ptr():
                    target.copy_(param.grad)
                target.add_(piece)
            param.grad = target
