"""Bytes one training step's collectives move, computed before launch (`fsdpkit plan`):
the same numbers the engine's counters (`fsdpkit.comm_stats`) show for a step once the
forward order is known, with no gradient accumulation.

Bytes are tensor bytes per collective, as the counters count them: an all-gather's output
(the whole unit: `fsdpkit.engine.quant.all_gather_bytes`, int8 rows included), a
reduce-scatter's input (the whole gradient), an all-reduce's tensor. A rank sends (W-1)/W
of an all-gather's or reduce-scatter's bytes over the wire and 2(W-1)/W of a ring
all-reduce's.

Per step, with N units in plan order (the root first): the forward gathers every unit;
with resharding strategies (full, hybrid) the backward gathers again every non-root unit
but the last (the forward ends with it and backward needs it first, so it stays gathered);
every trainable unit's gradient is reduce-scattered (all-reduced when F = 1) and, under
hybrid, its chunk all-reduced across replicas; one int32 flag per parameter is all-reduced
to agree which parameters got a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .engine.config import ShardingConfig
from .engine.quant import all_gather_bytes

FLAG_BYTES = 4  # the per-parameter "got a gradient" flags are int32


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
    factor = sharding.shard_factor(world_size)
    compute = _itemsize(sharding.mixed_precision.param_dtype or master_dtype)
    reduce = _itemsize(sharding.mixed_precision.reduce_dtype) if sharding.mixed_precision.reduce_dtype is not None else compute
    trainable = [unit for unit in units if unit.trainable]
    gathered = 0
    if factor > 1:
        regathered = [unit for unit in units[:-1] if unit.name] if sharding.reshard_after_forward else []
        for unit in units + regathered:
            gathered += all_gather_bytes(unit.chunk_numel, factor, element_bytes=compute, block=sharding.gather_block)
    scattered = sum(unit.padded_numel * reduce for unit in trainable) if factor > 1 else 0
    reduced = 0
    if factor == 1 and world_size > 1:
        reduced = sum(unit.padded_numel * reduce for unit in trainable)
    elif 1 < factor < world_size:
        reduced = sum(unit.chunk_numel * reduce for unit in trainable)
    if world_size > 1 and trainable:
        reduced += FLAG_BYTES * sum(unit.num_params for unit in units)
    return StepBytes(gathered, scattered, reduced)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
