"""`fsdpkit plan --time`: the predicted time of one training step before launching it.

The model is built once on the meta device; its units' FLOPs (fsdpkit.plan.flops) and layouts
give each unit's compute and collectives (fsdpkit.engine.traffic); fsdpkit.plan.simulate
simulates the engine's step policy on a hardware profile (fsdpkit.plan.profile). Each rank's
micro-batch is global batch / (world size x grad accum), so --scaling keeps it fixed (weak
scaling, as the FSDP paper's runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.step_policy import StepPolicy
from ..engine.traffic import flags_collective
from ..models.recipe import precision_names
from .flops import UnitWork
from .kernels import (
    OptimizerKernel,
    gather_cast_bytes,
    loss_bytes,
    optimizer_bytes_per_element,
    optimizer_kernel_for,
    reduce_cast_bytes,
)
from .memory import MemoryPlan, UnitSizes, plan_from_sizes, unit_sizes
from .meta import build_meta_model
from .profile import Hardware
from .request import PlanRequest
from .simulate import Recompute, StepSetup, StepTime, UnitCost, simulate
from .traffic import sharded_unit_traffic, wire_itemsizes


def optimizer_kernel(request: PlanRequest, hardware: Hardware) -> OptimizerKernel:
    """The optimizer's kernel the request runs: the one `fsdpkit train` builds, its parameters on a
    GPU where every rank has a device of its own and they stay on it."""
    if request.optimizer_kernel is not None:
        return request.optimizer_kernel
    return optimizer_kernel_for(hardware.compute_slots == 0 and not request.cpu_offload)


@dataclass(frozen=True)
class ModelCosts:
    """What the meta-device model tells: computed once, reused for every configuration."""

    plans: tuple
    master_bytes: int
    num_params: int
    work_per_sequence: tuple[UnitWork, ...]  # per unit, for one sequence (master dtype)


@dataclass(frozen=True)
class StepPrediction:
    request: PlanRequest
    hardware: Hardware
    ranks_per_node: int
    micro_batch: int
    memory: MemoryPlan
    time: StepTime
    activation_bytes: int  # the estimate at the activation peak of one micro-batch (activation_peak)

    def to_document(self) -> dict[str, Any]:
        time = self.time
        return {
            **self.memory.to_document(),
            "hardware": self.hardware.name,
            "ranks_per_node": self.ranks_per_node,
            "micro_batch": self.micro_batch,
            "grad_accum": self.request.grad_accum,
            "seq_len": self.request.seq_len,
            "step_time_s": time.step_time_s,
            "compute_s": time.compute_s,
            "exposed_comm_s": time.exposed_comm_s,
            "comm_s": time.comm_s,
            "flops_per_device": time.flops,
            "tflops_per_device": time.tflops_per_device,
            "hardware_tflops_per_device": time.hardware_tflops_per_device,
            "mfu": time.mfu,
            "tokens_per_s": time.tokens_per_s,
            "tokens_per_s_per_device": time.tokens_per_s / self.request.world_size,
            "terms": time.terms,
            "rates": {
                "peak_tflops": self.hardware.peak_flops(time.compute_dtype) / 1e12,
                "efficiency": self.hardware.fitted.efficiency,
                "memory_bw_gbs": self.hardware.memory_bw_gbs,
                "memory_efficiency": self.hardware.memory_efficiency,
            },
            "comm_bytes": time.comm_bytes,
            "activation_bytes": self.activation_bytes,
            "fits": self.fits,
        }

    @property
    def fits(self) -> bool:
        return self.memory.device_total + self.activation_bytes <= self.hardware.memory_gb * 1e9


def model_costs(request: PlanRequest) -> ModelCosts:
    from .flops import unit_work

    meta = build_meta_model(request.model, request, request.sharding.bucket_bytes)
    work = unit_work(meta.source, list(meta.plans), 1, request.seq_len)
    return ModelCosts(meta.plans, meta.master_bytes, meta.num_params, tuple(work))


def predict(
    request: PlanRequest, hardware: Hardware, costs: ModelCosts, *, per_node: int | None = None, recompute: Recompute | None = None
) -> StepPrediction:
    """The step of `request` on `hardware`, with `per_node` ranks per node (default: the profile's).
    `recompute` charges a checkpointing the engine does not run (None: what the request runs)."""
    sharding, world = request.sharding, request.world_size
    batch = request.micro_batch
    per_node = min(per_node or hardware.ranks_per_node, world)
    sizes = unit_sizes(list(costs.plans), sharding.shard_factor(world), master_bytes=costs.master_bytes)
    compute_bytes, _ = wire_itemsizes(sharding, costs.master_bytes)
    units = unit_costs(request, costs, sizes, batch)
    precision = precision_names(sharding.mixed_precision)[0]
    setup = StepSetup(
        policy=StepPolicy.of(sharding),
        hardware=hardware,
        world_size=world,
        ranks_per_node=per_node,
        micro_batches=request.grad_accum,
        no_sync=request.no_sync,
        compute_dtype="fp32" if precision == "none" else precision,
        optimizer_bytes=sum(size.local_numel for size in sizes if size.trainable)
        * optimizer_bytes_per_element(request.optimizer, optimizer_kernel(request, hardware)),
        loss_bytes=loss_bytes(batch * request.seq_len, max(w.logits for w in costs.work_per_sequence), compute=compute_bytes),
        optimizer_tensors=sum(param.requires_grad for plan in costs.plans for param in plan.params),
        flags=flags_collective(sum(len(plan.params) for plan in costs.plans), world),
        tokens_per_step=request.global_batch_size * request.seq_len,
        recompute=recompute,
    )
    memory = plan_from_sizes(sizes, request, num_params=costs.num_params)
    activations = activation_peak(costs.work_per_sequence, checkpointing=sharding.activation_checkpointing)
    scaled = activations * batch * compute_bytes // costs.master_bytes
    return StepPrediction(request, hardware, per_node, batch, memory, simulate(units, setup), scaled)


def unit_costs(request: PlanRequest, costs: ModelCosts, sizes: Sequence[UnitSizes], batch: int) -> list[UnitCost]:
    """Each unit's compute and collectives for one micro-batch of `batch` sequences on one rank."""
    sharding, master = request.sharding, costs.master_bytes
    compute_bytes, reduce_bytes = wire_itemsizes(sharding, master)
    factor, offload = sharding.shard_factor(request.world_size), sharding.cpu_offload
    return [
        UnitCost(
            name=size.name,
            trainable=size.trainable,
            forward_flops=work.forward_flops * batch,
            backward_flops=work.backward_flops * batch,
            forward_attention_flops=work.forward_attention_flops * batch,
            forward_bytes=work.forward_bytes * batch * compute_bytes // master,
            backward_bytes=work.backward_bytes * batch * compute_bytes // master,
            forward_ops=work.forward_ops,
            backward_ops=work.backward_ops,
            traffic=sharded_unit_traffic(size.padded_numel, size.chunk_numel, size.trainable, sharding, request.world_size, master),
            param_bytes=size.padded_numel * compute_bytes,
            shard_bytes=size.chunk_numel * size.master_bytes,
            members=len(plan.members),
            gather_cast_bytes=gather_cast_bytes(
                size.padded_numel, size.chunk_numel, shard_factor=factor, master=size.master_bytes, compute=compute_bytes, offload=offload
            ),
            reduce_cast_bytes=reduce_cast_bytes(
                size.padded_numel, size.chunk_numel, master=size.master_bytes, compute=compute_bytes, reduce=reduce_bytes, offload=offload
            )
            if size.trainable
            else 0,
        )
        for size, work, plan in zip(sizes, costs.work_per_sequence, costs.plans, strict=True)
    ]


def activation_peak(work: Sequence[UnitWork], *, checkpointing: bool) -> int:
    """The activations one sequence keeps at the end of its forward (in the master dtype): every
    byte the forward's operators write, an upper bound of what autograd saves; under activation
    checkpointing each unit's inputs plus the largest unit's activations, recomputed in backward."""
    if checkpointing:
        return sum(w.input_bytes for w in work) + max((w.activation_bytes for w in work), default=0)
    return sum(w.activation_bytes for w in work)
