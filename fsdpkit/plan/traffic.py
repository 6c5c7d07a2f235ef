"""Bytes one training step's collectives move, computed before launch (`fsdpkit plan`):
the same numbers the engine's counters (`fsdpkit.comm_stats`) show for a step once the
forward order is known, with no gradient accumulation.

Bytes are tensor bytes per collective, as the counters count them: an all-gather's output
(the whole unit: `fsdpkit.engine.quant.all_gather_bytes`, int8 rows included), a
reduce-scatter's input (the whole gradient), an all-reduce's tensor. A rank sends (W-1)/W
of an all-gather's or reduce-scatter's bytes over the wire and 2(W-1)/W of a ring
all-reduce's.

A step's collectives are each unit's (engine/traffic.py), as many times as the engine's one
step policy issues them (engine/step_policy.py `step_events`): an all-gather per gather, a
reduction per reduce; and, when anything is trained, one int32 flag per parameter
all-reduced to agree which parameters got a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.config import ShardingConfig
from ..engine.step_policy import Op, StepPolicy, step_events
from ..engine.traffic import Collective, UnitTraffic, flags_collective, unit_traffic


@dataclass(frozen=True)
class UnitComm:
    """What the byte count needs of one unit."""

    name: str
    padded_numel: int
    chunk_numel: int
    trainable: bool
    num_params: int


@dataclass(frozen=True)
class StepBytes:
    all_gather: int
    reduce_scatter: int
    all_reduce: int

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce

    def as_dict(self) -> dict[str, int]:
        return {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter, "all_reduce": self.all_reduce, "total": self.total}


def step_bytes(units: list[UnitComm], sharding: ShardingConfig, world_size: int, *, master_dtype: torch.dtype = torch.float32) -> StepBytes:
    master = itemsize(master_dtype)
    traffic = {
        unit.name: sharded_unit_traffic(unit.padded_numel, unit.chunk_numel, unit.trainable, sharding, world_size, master) for unit in units
    }
    order = [(unit.name, unit.trainable) for unit in units]
    if order and order[0][0]:  # no root unit (the root module holds no parameter): every unit is a block
        order.insert(0, ("", False))
    issued: list[Collective | None] = []
    for event in step_events(order, StepPolicy.of(sharding)):
        if event.op is Op.GATHER and event.unit in traffic:
            issued.append(traffic[event.unit].gather)
        elif event.op is Op.REDUCE and event.unit in traffic:
            issued += [traffic[event.unit].reduce, traffic[event.unit].replica_reduce]
    if any(unit.trainable for unit in units):
        issued.append(flags_collective(sum(unit.num_params for unit in units), world_size))
    moved = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce"), 0)
    for collective in filter(None, issued):
        moved[collective.kind] += collective.bytes
    return StepBytes(**moved)


def wire_itemsizes(sharding: ShardingConfig, master_bytes: int) -> tuple[int, int]:
    """(bytes per element gathered and computed with, bytes per element reduced) under the
    sharding's mixed precision, for master weights of `master_bytes` per element."""
    mixed = sharding.mixed_precision
    compute = itemsize(mixed.param_dtype) if mixed.param_dtype is not None else master_bytes
    return compute, itemsize(mixed.reduce_dtype) if mixed.reduce_dtype is not None else compute


def sharded_unit_traffic(
    padded_numel: int, chunk_numel: int, trainable: bool, sharding: ShardingConfig, world_size: int, master_bytes: int
) -> UnitTraffic:
    """The collectives of one unit under `sharding` at `world_size`."""
    factor = sharding.shard_factor(world_size)
    compute, reduce = wire_itemsizes(sharding, master_bytes)
    return unit_traffic(
        padded_numel=padded_numel,
        chunk_numel=chunk_numel,
        compute_bytes=compute,
        reduce_bytes=reduce,
        gather_block=sharding.gather_block,
        shard_factor=factor,
        replicas=world_size // factor,
        trainable=trainable,
    )


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
