"""A read-only description of a sharded model, for code outside the engine (checkpoints,
export): which units exist, which parameters each holds, and which fragment of each this
rank keeps. Checkpoint code reads the engine through this, never through its internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..flat_layout import FlatLayout, Fragment
from .sharded import get_state


@dataclass(frozen=True)
class ParamView:
    name: str  # canonical name (first in named_parameters() order)
    shape: tuple[int, ...]
    requires_grad: bool
    aliases: tuple[str, ...]  # further names of a tied parameter
    fragment: Fragment  # this rank's piece of the parameter's flat form
    tensor: nn.Parameter  # the 1-D sharded parameter (fragment.param_range.size elements)


@dataclass(frozen=True)
class UnitView:
    name: str
    layout: FlatLayout
    params: tuple[ParamView, ...]


@dataclass(frozen=True)
class ShardedModelView:
    units: tuple[UnitView, ...]
    strategy: str
    world_size: int  # ranks in the data-parallel group
    rank: int
    shard_factor: int  # ranks one flat parameter is split over
    shard_rank: int
    writes_shards: bool  # the first replica: the ranks that hold what a checkpoint stores
    group: Any  # the data-parallel process group
    device: torch.device
    replicas: int  # copies of each shard (hybrid or no sharding), 1 when fully sharded
    replica: int  # which copy this rank holds: its rank in `replicate_group`
    replicate_group: Any | None  # the ranks holding the same fragments as this one; None with one replica


def describe(module: nn.Module) -> ShardedModelView:
    state = get_state(module)
    units = []
    for unit in state.units:
        params = []
        for spec, fragment, param in zip(unit.spec.params, unit.fragments, unit.params, strict=True):
            names = [f"{m}.{a}" if m else a for m, a in spec.uses]
            params.append(
                ParamView(spec.name, tuple(spec.shape), spec.requires_grad, tuple(n for n in names if n != spec.name), fragment, param)
            )
        units.append(UnitView(unit.name, unit.layout, tuple(params)))
    mesh = state.mesh
    return ShardedModelView(
        tuple(units),
        str(state.config.strategy),
        mesh.world_size,
        mesh.rank,
        mesh.shard_factor,
        mesh.shard_rank,
        mesh.is_replica_leader,
        mesh.group,
        state.device,
        mesh.replicate_size,
        mesh.rank // mesh.shard_factor,
        mesh.replicate_group if mesh.replicate_size > 1 else None,
    )
