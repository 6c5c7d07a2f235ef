"""Per-rank memory of a sharded run, computed before launch: `fsdpkit plan`.

Builds the model on the meta device (nothing real), lays out every unit's flat parameter
with the engine's own plan (fsdpkit.engine.wrapping) and counts the bytes the engine holds:

    sharded parameters  every unit's chunk, master dtype (fp32), for the whole run
    sharded gradients   the same size, master dtype, from the first backward on
    optimizer state     AdamW: exp_avg + exp_avg_sq over the rank's real elements (padding
                        has no parameter), plus a 4-byte `step` per parameter; SGD: none
    unsharded in flight the full padded flat parameters (compute dtype) of the units
                        gathered at once, plus full gradients until their reduction
                        completes (memory_timeline.py replays the schedule)
    no_sync gradients   with --no-sync, a full unsharded gradient per unit on every rank

Activations, the temporary buffers of collectives and the allocator's caching are left
out. With CPU offload the sharded parameters, gradients and optimizer state live on the
host; the device holds the unsharded bytes. Rank 0 of a shard group is reported: the
padding sits at the end, so it holds the most real elements.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engine.wrapping import UnitSpec
from ..errors import UsageError
from ..models.recipe import Optimizer, precision_names
from .meta import build_meta_model
from .request import PlanRequest
from .timeline import Peak, UnitFootprint, peak_unsharded
from .traffic import StepBytes, UnitComm, step_bytes

# Per-element states each optimizer keeps in the master dtype, and bytes of its per-parameter step count.
OPTIMIZER_STATES = {Optimizer.ADAMW: (2, 4), Optimizer.SGD: (0, 0)}  # AdamW: exp_avg, exp_avg_sq; `step` a float32 scalar


@dataclass(frozen=True)
class UnitSizes:
    """One unit's flat parameter in elements, for one rank of its shard group."""

    name: str
    numel: int
    padded_numel: int
    chunk_numel: int
    local_numel: int  # real (non-padding) elements in this rank's chunk
    trainable_params: int
    master_bytes: int  # bytes per element of the master (sharded) parameters

    @property
    def trainable(self) -> bool:
        return self.trainable_params > 0


@dataclass(frozen=True)
class MemoryPlan:
    request: PlanRequest
    num_params: int
    shard_factor: int
    units: tuple[UnitSizes, ...]
    sharded_params: int
    sharded_grads: int
    optimizer_state: int
    no_sync_grads: int
    largest_unit: UnitFootprint
    peak: Peak
    notes: tuple[str, ...] = field(default_factory=tuple)
    comm_per_step: StepBytes | None = None  # collective bytes of one step (comm_plan.py)

    @property
    def persistent(self) -> int:
        return self.sharded_params + self.sharded_grads + self.optimizer_state

    @property
    def device_total(self) -> int:
        on_device = self.no_sync_grads + self.peak.bytes  # the peak includes the sharded gradients
        return on_device if self.request.cpu_offload else on_device + self.sharded_params + self.optimizer_state

    @property
    def host_total(self) -> int:
        return self.persistent if self.request.cpu_offload else 0

    @property
    def total(self) -> int:
        return self.device_total + self.host_total

    def to_document(self) -> dict[str, Any]:
        request = self.request
        return {
            "model": request.model,
            "num_params": self.num_params,
            "units": len(self.units),
            "world_size": request.world_size,
            "strategy": str(request.sharding.strategy),
            "shard_factor": self.shard_factor,
            "replicas": request.world_size // self.shard_factor,
            "mixed_precision": precision_names(request.sharding.mixed_precision)[0],
            "optimizer": str(request.optimizer),
            "cpu_offload": request.cpu_offload,
            "no_sync": request.no_sync,
            "backward_prefetch": str(request.sharding.backward_prefetch),
            "forward_prefetch": request.sharding.forward_prefetch,
            "bytes": {
                "sharded_params": self.sharded_params,
                "sharded_grads": self.sharded_grads,
                "optimizer_state": self.optimizer_state,
                "no_sync_grads": self.no_sync_grads,
                "largest_unit_unsharded": self.largest_unit.param_bytes,
                "peak_unsharded": self.peak.bytes,
                "device_total": self.device_total,
                "host_total": self.host_total,
                "total": self.total,
            },
            "largest_unit": self.largest_unit.name,
            "in_flight_at_peak": {"params": list(self.peak.params), "grads": list(self.peak.grads), "phase": self.peak.phase},
            "notes": list(self.notes),
            "allgather_dtype": request.sharding.allgather_dtype.value,
            "quant_block": request.sharding.quant_block,
            "bucket_bytes": request.sharding.bucket_bytes,
            "comm_bytes_per_step": self.comm_per_step.as_dict() if self.comm_per_step is not None else None,
        }


def unit_sizes(plans: list[UnitSpec], shard_factor: int, *, shard_rank: int = 0, master_bytes: int = 4) -> list[UnitSizes]:
    """Each unit's element counts for `shard_rank` (0 holds the most real elements)."""
    sizes = []
    for plan in plans:
        layout = plan.layout(shard_factor)
        local = sum(fragment.param_range.size for fragment in layout.fragments(shard_rank))
        sizes.append(
            UnitSizes(
                name=plan.name,
                numel=layout.numel,
                padded_numel=layout.padded_numel,
                chunk_numel=layout.chunk_numel,
                local_numel=local,
                trainable_params=sum(p.requires_grad for p in plan.params),
                master_bytes=master_bytes,
            )
        )
    return sizes


def footprint(unit: UnitSizes, request: PlanRequest, shard_factor: int) -> UnitFootprint:
    """What `unit` holds on the device while unsharded: parameters in the compute dtype
    (nothing extra when F = 1 without a cast: the full parameter is the shard), and during
    backward a gradient in the compute dtype plus a copy in the reduce dtype if it differs."""
    mixed = request.sharding.mixed_precision
    compute = _itemsize(mixed.param_dtype, unit.master_bytes)
    reduce = _itemsize(mixed.reduce_dtype, compute)
    aliases = shard_factor == 1 and compute == unit.master_bytes and not request.cpu_offload
    param_bytes = 0 if aliases else unit.padded_numel * compute
    grad_bytes = unit.padded_numel * compute + (unit.padded_numel * reduce if reduce != compute else 0) if unit.trainable else 0
    on_device = unit.trainable and not request.cpu_offload
    return UnitFootprint(
        unit.name,
        param_bytes,
        grad_bytes,
        unit.trainable,
        reduced_bytes=unit.chunk_numel * unit.master_bytes if on_device else 0,
        issued_bytes=unit.chunk_numel * reduce if on_device else 0,
        reduced_on_completion=shard_factor == 1,
    )


def plan_from_sizes(units: list[UnitSizes], request: PlanRequest, *, num_params: int) -> MemoryPlan:
    """The arithmetic: per-rank bytes from the units' sizes (root first, forward order)."""
    factor = request.sharding.shard_factor(request.world_size)
    trainable = [unit for unit in units if unit.trainable]
    states, step_bytes = OPTIMIZER_STATES[request.optimizer]
    optimizer_state = sum(states * unit.local_numel * unit.master_bytes + step_bytes * unit.trainable_params for unit in trainable)
    footprints = [footprint(unit, request, factor) for unit in units]
    largest = max(footprints, key=lambda f: f.param_bytes, default=UnitFootprint("", 0, 0))
    notes = ["activations, collective buffers and allocator caching are not included"]
    if request.cpu_offload:
        notes.append("cpu offload: sharded parameters, gradients and optimizer state are host memory")
    return MemoryPlan(
        request=request,
        num_params=num_params,
        shard_factor=factor,
        units=tuple(units),
        sharded_params=sum(unit.chunk_numel * unit.master_bytes for unit in units),
        sharded_grads=sum(unit.chunk_numel * unit.master_bytes for unit in trainable),
        optimizer_state=optimizer_state,
        no_sync_grads=sum(f.grad_bytes for f in footprints) if request.no_sync else 0,
        largest_unit=largest,
        peak=peak_unsharded(footprints, request.policy),
        notes=tuple(notes),
    )


def plan_memory(request: PlanRequest, *, shard_rank: int = 0) -> MemoryPlan:
    """Build `request.model` on the meta device and plan its per-rank memory."""
    factor = request.sharding.shard_factor(request.world_size)
    if not 0 <= shard_rank < factor:
        raise UsageError(f"shard rank {shard_rank} is outside the shard group of {factor} ranks")
    meta = build_meta_model(request.model, request, request.sharding.bucket_bytes)
    sizes = unit_sizes(list(meta.plans), factor, shard_rank=shard_rank, master_bytes=meta.master_bytes)
    plan = plan_from_sizes(sizes, request, num_params=meta.num_params)
    comm = [UnitComm(s.name, s.padded_numel, s.chunk_numel, s.trainable, len(p.params)) for s, p in zip(sizes, meta.plans, strict=True)]
    return dataclasses.replace(plan, comm_per_step=step_bytes(comm, request.sharding, request.world_size, master_dtype=meta.master_dtype))


def _itemsize(dtype: torch.dtype | None, default: int) -> int:
    return default if dtype is None else torch.empty(0, dtype=dtype).element_size()
