"""The process groups one sharded model uses: where it shards and where it replicates."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..dist.comm import new_group
from .config import ShardingConfig


@dataclass(frozen=True)
class ShardMesh:
    """rank/world_size: in the data-parallel group. The shard group holds the F ranks that
    split a flat parameter; the replicate group the W/F ranks holding the same chunk."""

    world_size: int
    rank: int
    group: Any
    shard_factor: int
    shard_rank: int
    shard_group: Any | None
    replicate_size: int
    replicate_group: Any | None

    @property
    def is_replica_leader(self) -> bool:
        """True on the ranks of the first replica (the ones that write shards to disk)."""
        return self.rank // self.shard_factor == 0 if self.replicate_size > 1 else True


def build_mesh(config: ShardingConfig, group: Any = None) -> ShardMesh:
    """Create the groups for `config` over `group` (default: the whole world).

    Every rank of `group` must call this, in the same order relative to other group creation.
    """
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    factor = config.shard_factor(world_size)
    replicate_size = world_size // factor
    ranks = dist.get_process_group_ranks(group)
    shard_group = group if factor == world_size else None
    replicate_group = group if factor == 1 and world_size > 1 else None
    if 1 < factor < world_size:
        for start in range(0, world_size, factor):
            new = new_group(ranks[start : start + factor])
            if start <= rank < start + factor:
                shard_group = new
        for offset in range(factor):
            new = new_group(ranks[offset::factor])
            if rank % factor == offset:
                replicate_group = new
    return ShardMesh(
        world_size=world_size,
        rank=rank,
        group=group,
        shard_factor=factor,
        shard_rank=rank % factor,
        shard_group=shard_group if factor > 1 else None,
        replicate_size=replicate_size,
        replicate_group=replicate_group,
    )
