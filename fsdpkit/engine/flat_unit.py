"""One unit's FlatParameter: the sharded master chunk, the unsharded buffer the unit computes
with, the reduction of its gradient back into the chunk, and the unit's lifecycle.

Sharded state: each original parameter is an nn.Parameter that is a 1-D view of its own
fragment of `flat_shard` (possibly empty); the optimizer updates those views in place.
Unsharded state: `full_flat` (a leaf that autograd accumulates into) holds the whole padded
flat parameter in the compute dtype, and each original parameter is a view of it with its
original shape.

    SHARDED --unshard(async)--> GATHERING --wait--> GATHERED --show--> UNSHARDED
       ^                                                                   |
       +------------------------------- free_full -------------------------+

Per backward, separately: PENDING -> PREPARED (gathered for its gradient computation) ->
REDUCED (its gradient reduction issued), back to PENDING at the end of backward.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..dist.comm import Collectives
from ..flat_layout import FlatLayout
from .config import MixedPrecision
from .memory import MemoryCounter, tensor_bytes
from .mesh import ShardMesh
from .quant import Int8BlockCodec
from .wrapping import UnitSpec

SHAPE_ATTR = "_fsdpkit_shape"


class UnitState(enum.Enum):
    """Where a unit's parameters are."""

    SHARDED = "sharded"  # only this rank's chunk exists; the module attributes are its 1-D fragments
    GATHERING = "gathering"  # an all-gather into the full buffer is in flight
    GATHERED = "gathered"  # the full buffer holds the unit; the attributes still show the fragments
    UNSHARDED = "unsharded"  # the attributes are views of the full buffer, with their original shapes


class BackwardState(enum.Enum):
    """How far the current backward has got with a unit."""

    PENDING = "pending"  # not reached yet
    PREPARED = "prepared"  # its pre-backward hook ran: gathered for its gradient computation
    REDUCED = "reduced"  # its gradient reduction was issued


@dataclass
class PendingReduction:
    unit: FlatUnit
    output: torch.Tensor
    source: torch.Tensor | None  # the full gradient, kept alive until the collective completes
    work: Any


class FlatUnit:
    def __init__(
        self,
        spec: UnitSpec,
        modules: dict[str, nn.Module],
        mesh: ShardMesh,
        comms: Collectives,
        mixed_precision: MixedPrecision,
        memory: MemoryCounter,
        *,
        device: torch.device,
        offload: bool = False,
        gather_stream: torch.cuda.Stream | None = None,
        gather_block: int | None = None,
    ) -> None:
        self.name = spec.name
        self.spec = spec
        self.mesh = mesh
        self.comms = comms
        self.memory = memory
        self.is_root = spec.members == ("",)
        self.members = [modules[name] for name in spec.members]
        self.layout: FlatLayout = spec.layout(mesh.shard_factor)
        self.fragments = self.layout.fragments(mesh.shard_rank)
        self.padded_numel, self.chunk_numel = self.layout.padded_numel, self.layout.chunk_numel
        self.split_sizes = self.layout.split_sizes()  # (the layout computes these on every call)
        self.uses = [[(modules[m], attr) for m, attr in p.uses] for p in spec.params]
        originals = [getattr(uses[0][0], uses[0][1]) for uses in self.uses]
        dtypes = {t.dtype for t in originals}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"unit {self.name or '<root>'!r} mixes parameter dtypes {sorted(map(str, dtypes))}; one floating dtype per unit is required"
            )
        self.master_dtype = dtypes.pop()
        self.compute_dtype = mixed_precision.param_dtype or self.master_dtype
        self.reduce_dtype = mixed_precision.reduce_dtype or self.compute_dtype
        self.device, self.offload, self.gather_stream = device, offload, gather_stream
        self.host = torch.device("cpu") if offload else device
        # int8 all-gather: every rank's chunk is quantized in blocks, even unsent at F = 1,
        # so a unit computes with the same weights whatever the world size.
        self.codec = Int8BlockCodec(self.chunk_numel, gather_block) if gather_block is not None else None

        self._make_shard(spec, originals)
        self.grad_shard: torch.Tensor | None = None
        memory.add("sharded_params", tensor_bytes(self.flat_shard))

        self.aliases_shard = mesh.shard_factor == 1 and self.compute_dtype == self.master_dtype and not offload and self.codec is None
        if self.aliases_shard:
            self.full_flat = self.flat_shard.detach()
        else:
            self.full_flat = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
            self.full_flat.untyped_storage().resize_(0)
        self.full_flat.requires_grad_(self.trainable)
        self.state = UnitState.SHARDED
        self.backward = BackwardState.PENDING
        self.frozen_uses = 0  # uses of a frozen unit whose backward is still to come
        self._gather_work: Any = None
        self.used = [0] * len(self.params)  # 1: the parameter got a gradient in this backward
        self._holds_unsynced_grad = False  # full_flat.grad accumulates across no_sync backwards
        self._set_params(self.params)

    def _make_shard(self, spec: UnitSpec, originals: list[torch.Tensor]) -> None:
        """This rank's flat shard and the sharded parameters viewing it. Parameters still on the
        meta device are filled later (deferred_init) through fill_parameter(); until then their
        pages are not touched, so deferred init holds memory only for what it has materialised.
        The padding after them is zero."""
        self.flat_shard = torch.empty(self.chunk_numel, dtype=self.master_dtype, device=self.host)
        with torch.no_grad():
            self.flat_shard[sum(fragment.param_range.size for fragment in self.fragments) :].zero_()
            for fragment, original in zip(self.fragments, originals, strict=True):
                if not original.is_meta:
                    source = original.detach().reshape(-1)[fragment.param_range.start : fragment.param_range.end]
                    self._local(self.flat_shard, fragment).copy_(source)
        self.params: list[nn.Parameter] = []
        for fragment, param_spec in zip(self.fragments, spec.params, strict=True):
            param = nn.Parameter(self._local(self.flat_shard, fragment), requires_grad=param_spec.requires_grad)
            setattr(param, SHAPE_ATTR, torch.Size(param_spec.shape))
            self.params.append(param)
        self.trainable = any(p.requires_grad for p in self.params)

    # ----- layout helpers
    @staticmethod
    def _local(flat: torch.Tensor, fragment) -> torch.Tensor:
        return flat[fragment.local_offset : fragment.local_offset + fragment.param_range.size]

    def _set_params(self, tensors: Sequence[torch.Tensor]) -> None:
        for uses, tensor in zip(self.uses, tensors, strict=True):
            for module, attr in uses:
                # Unsharded views are plain tensors; torch's stubs type _parameters as Parameter only.
                module._parameters[attr] = tensor  # type: ignore[assignment]

    def fill_parameter(self, index: int, full: torch.Tensor) -> None:
        """Copy this rank's fragment of parameter `index` from its full (unsharded) value."""
        span = self.fragments[index].param_range
        with torch.no_grad():
            self.params[index].copy_(full.reshape(-1)[span.start : span.end])

    def end_backward(self, *, keep_usage: bool) -> None:
        self.backward = BackwardState.PENDING
        self.frozen_uses = 0
        if not keep_usage:
            self.used = [0] * len(self.params)

    # ----- unshard / free_full
    @property
    def is_gathered(self) -> bool:
        """The all-gather was at least issued: the full buffer is (or will be) filled."""
        return self.state is not UnitState.SHARDED

    def unshard(self, *, async_op: bool = False) -> Any:
        """Start (or do) the all-gather of the unit into `full_flat` in the compute dtype.

        Returns the work handle when asynchronous; `wait_unshard()` before using the data.
        """
        if self.is_gathered:
            return None
        if self.aliases_shard:
            self.state = UnitState.GATHERED
            return None
        full = self.full_flat
        if full.untyped_storage().size() == 0:
            full.untyped_storage().resize_(self.padded_numel * full.element_size())
            self.memory.add("unsharded_params", tensor_bytes(full))
        # On CUDA a prefetch runs on its own stream (the paper's section 3.3: issued from the
        # compute stream, NCCL would wait for compute queued before it); wait() joins it back.
        side_stream = self.gather_stream if async_op and self.mesh.shard_factor > 1 else None
        compute_stream = torch.cuda.current_stream(self.device) if side_stream is not None else None
        with torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext():
            if side_stream is not None and compute_stream is not None:
                side_stream.wait_stream(compute_stream)  # the optimizer may have just updated the shard
            source = self.flat_shard.to(device=self.device, dtype=self.compute_dtype, non_blocking=True)
            # `.data`: fills the buffer without bumping the version counter autograd checks on saved views.
            work = self._gather(full.data, source, async_op=async_op)
            if work is not None:
                self._gather_work = work
                self.state = UnitState.GATHERING
                return work
        self.state = UnitState.GATHERED
        return None

    def _gather(self, full: torch.Tensor, source: torch.Tensor, *, async_op: bool) -> Any:
        """All-gather `source` (this rank's chunk, compute dtype) into `full`, through the
        int8 codec when there is one; the work handle when asynchronous."""
        group = self.mesh.shard_group
        if self.mesh.shard_factor == 1:
            if self.codec is not None:
                self.codec.decode(self.codec.encode(source), full)
            else:
                full.copy_(source)
            return None
        if self.codec is not None:
            return self.comms.all_gather_encoded(full, source, group, self.codec, async_op=async_op, label=self.name)
        return self.comms.all_gather(full, source, group, async_op=async_op, label=self.name)

    def wait_unshard(self) -> None:
        if self.state is UnitState.GATHERING:
            work, self._gather_work = self._gather_work, None
            work.wait()
            self.state = UnitState.GATHERED

    def show_unsharded(self, *, track_grad: bool) -> None:
        """Point every original parameter at its view of `full_flat`, with its own shape.

        With track_grad the views are built under grad mode even where autograd turned it off
        (a pre-backward hook): recomputation under activation checkpointing must see views
        that carry a grad_fn, or it saves other tensors than the original forward did.
        """
        self.wait_unshard()
        with torch.enable_grad() if track_grad else contextlib.nullcontext():
            base = self.full_flat if (track_grad and self.trainable) else self.full_flat.detach()
            pieces = torch.split(base, self.split_sizes)
            views = [
                (piece if param_spec.requires_grad else piece.detach()).view(param_spec.shape)
                for piece, param_spec in zip(pieces, self.spec.params, strict=False)  # the last piece is the padding
            ]
        if base.requires_grad:
            # One hook on the split's backward sees which pieces got a gradient (the others None).
            grad_fn = pieces[0].grad_fn
            assert grad_fn is not None, "a split of a tensor that requires grad has a grad_fn"
            grad_fn.register_prehook(self._mark_used)
        self._set_params(views)
        self.state = UnitState.UNSHARDED

    def _mark_used(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        for index, grad in enumerate(grads):
            if grad is not None:
                self.used[index] = 1

    def free_full(self) -> None:
        """Back to the sharded state: original names show the fragments; free the full buffer."""
        self._set_params(self.params)
        if not self.is_gathered:
            return
        self.wait_unshard()
        self.state = UnitState.SHARDED
        if not self.aliases_shard and self.full_flat.untyped_storage().size():
            self.full_flat.untyped_storage().resize_(0)
            self.memory.add("unsharded_params", -tensor_bytes(self.full_flat))

    # ----- gradients
    def release_cleared_grads(self) -> None:
        """Free the sharded gradient once the optimizer cleared every .grad (zero_grad with
        set_to_none), so it is not held through the next forward and backward."""
        if self.grad_shard is not None and all(param.grad is None for param in self.params):
            self.memory.add("sharded_grads", -tensor_bytes(self.grad_shard))
            self.grad_shard = None

    def keep_grad_unsynced(self) -> None:
        """no_sync: leave the unsharded gradient in full_flat.grad, where the next backward adds to it."""
        if not self._holds_unsynced_grad:
            grad = self.full_flat.grad
            assert grad is not None, "called after a backward produced the unit's gradient"
            self._holds_unsynced_grad = True
            self.memory.add("unsharded_grads", tensor_bytes(grad))

    def take_grad(self) -> torch.Tensor:
        """Take the unsharded gradient out of full_flat.grad to reduce it: zeros when this
        rank computed none (every rank must still take part in the reduction)."""
        grad, self.full_flat.grad = self.full_flat.grad, None
        if grad is None:
            grad = torch.zeros(self.padded_numel, dtype=self.compute_dtype, device=self.device)
        if not self._holds_unsynced_grad:
            self.memory.add("unsharded_grads", tensor_bytes(grad))
        self._holds_unsynced_grad = False
        return grad

    def drop_unsynced_grad(self) -> None:
        """Discard a gradient a failed backward may have half-accumulated."""
        if self._holds_unsynced_grad and self.full_flat.grad is not None:
            self.memory.add("unsharded_grads", -tensor_bytes(self.full_flat.grad))
        self.full_flat.grad = None
        self._holds_unsynced_grad = False

    def issue_reduction(self, full_grad: torch.Tensor) -> PendingReduction:
        """Start reducing a full padded gradient (from take_grad): reduce-scatter in the shard
        group (or all-reduce across replicas when F = 1)."""
        grad = full_grad if full_grad.dtype == self.reduce_dtype else full_grad.to(self.reduce_dtype)
        if self.mesh.shard_factor > 1:
            output = torch.empty(self.chunk_numel, dtype=self.reduce_dtype, device=self.device)
            work = self.comms.reduce_scatter(output, grad, self.mesh.shard_group, async_op=True, label=self.name)
        else:
            output = grad
            work = None
            if self.mesh.replicate_group is not None:
                work = self.comms.all_reduce(output, self.mesh.replicate_group, async_op=True, label=self.name)
        if output is not full_grad:
            self.memory.add("sharded_grads", tensor_bytes(output))  # the reduce-scatter's output chunk
        self.backward = BackwardState.REDUCED
        return PendingReduction(self, output, full_grad, work)

    def complete_reduction(self, pending: PendingReduction) -> None:
        """Wait for the reduction, all-reduce across replicas (hybrid) and average; the full
        gradient it read from is released (pending.source = None)."""
        if pending.source is None:
            return
        source_bytes = tensor_bytes(pending.source)
        output_bytes = 0 if pending.output is pending.source else tensor_bytes(pending.output)
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
        reduced = pending.output
        if self.mesh.shard_factor > 1 and self.mesh.replicate_group is not None:
            self.comms.all_reduce(reduced, self.mesh.replicate_group, label=self.name)
        pending.output = reduced.to(device=self.host, dtype=self.master_dtype).div_(self.mesh.world_size)
        pending.source = None
        self.memory.add("unsharded_grads", -source_bytes)
        self.memory.add("sharded_grads", tensor_bytes(pending.output) - output_bytes)

    def drop_reduction(self, pending: PendingReduction) -> None:
        """A failed backward: wait for the collective (every rank issued it) and forget it."""
        if pending.work is not None:
            pending.work.wait()
        if pending.source is not None:
            self.memory.add("unsharded_grads", -tensor_bytes(pending.source))
        if pending.output is not pending.source:
            self.memory.add("sharded_grads", -tensor_bytes(pending.output))

    def accumulate(self, pending: PendingReduction, used: torch.Tensor) -> None:
        """Add a completed reduction into the sharded gradient of every parameter that some
        rank gave a gradient (the others keep grad None, as an unused parameter should)."""
        reduced = pending.output
        if self.grad_shard is None:
            # The reduction's output becomes the sharded gradient: no copy, no second buffer
            # (the memory counter already holds it since the reduction was issued).
            self.grad_shard = reduced
            for index, (fragment, param) in enumerate(zip(self.fragments, self.params, strict=True)):
                if param.requires_grad and used[index]:
                    param.grad = self._local(self.grad_shard, fragment)
            return
        self.memory.add("sharded_grads", -tensor_bytes(reduced))  # added into grad_shard, then dropped
        for index, (fragment, param) in enumerate(zip(self.fragments, self.params, strict=True)):
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
