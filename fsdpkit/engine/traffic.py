"""The collectives one unit issues and the bytes each carries, as the engine's Collectives count
them (fsdpkit.dist.comm: the whole gathered or reduced tensor, elements x element size). Pure
arithmetic on the unit's layout; the step-time model adds them up, and a test checks them
against the engine's own counters.

    all-gather      the full padded parameter in the compute dtype, or its int8 rows with
                    their scales (quant.all_gather_bytes), per gather (F > 1)
    reduce-scatter  the full padded gradient in the reduce dtype (F > 1)
    all-reduce      F = 1 with replicas: the full padded gradient in the reduce dtype;
                    hybrid: the reduced chunk, across replicas, when its reduction completes
    grad-flags      one int32 per parameter, all-reduced at the end of a synced backward
"""

from __future__ import annotations

from dataclasses import dataclass

from .quant import all_gather_bytes

FLAG_BYTES = 4  # the used-parameter flags are int32


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce, as comm_stats names them
    bytes: int
    group_size: int
    spans_world: bool  # the group's ranks are spread over the whole world (replicas), not consecutive


@dataclass(frozen=True)
class UnitTraffic:
    gather: Collective | None  # per all-gather of the unit; None: F = 1, the shard is the parameter
    reduce: Collective | None  # issued after the unit's backward
    replica_reduce: Collective | None  # hybrid: when the reduction completes


def unit_traffic(
    *,
    padded_numel: int,
    chunk_numel: int,
    compute_bytes: int,
    reduce_bytes: int,
    gather_block: int | None,
    shard_factor: int,
    replicas: int,
    trainable: bool,
) -> UnitTraffic:
    gathered = all_gather_bytes(chunk_numel, shard_factor, element_bytes=compute_bytes, block=gather_block)
    gather = Collective("all_gather", gathered, shard_factor, False) if shard_factor > 1 else None
    reduce = replica_reduce = None
    if trainable and shard_factor > 1:
        reduce = Collective("reduce_scatter", padded_numel * reduce_bytes, shard_factor, False)
        if replicas > 1:
            replica_reduce = Collective("all_reduce", chunk_numel * reduce_bytes, replicas, True)
    elif trainable and replicas > 1:
        reduce = Collective("all_reduce", padded_numel * reduce_bytes, replicas, True)
    return UnitTraffic(gather, reduce, replica_reduce)


def flags_collective(num_params: int, world_size: int) -> Collective | None:
    if world_size == 1 or num_params == 0:
        return None
    return Collective("all_reduce", num_params * FLAG_BYTES, world_size, True)
