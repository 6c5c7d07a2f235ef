"""Predictions over many runs: the same run at other world sizes (`plan --scaling`), and the
fastest configurations that fit (`plan --recommend`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from ..engine.config import BackwardPrefetch, ShardingConfig, Strategy
from ..errors import UsageError
from .predict import ModelCosts, StepPrediction, predict
from .profile import Hardware
from .request import PlanRequest


def parse_world_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UsageError(f"--scaling {text!r} must be world sizes >= 1 separated by commas, e.g. 8,64,512")
    return sizes


def at_world_size(request: PlanRequest, world_size: int) -> PlanRequest:
    """The same run on `world_size` ranks, each with the same micro-batch (weak scaling)."""
    batch = request.micro_batch * world_size * request.grad_accum
    return dataclasses.replace(request, world_size=world_size, global_batch_size=batch)


def scaling(
    request: PlanRequest, hardware: Hardware, costs: ModelCosts, world_sizes: list[int], *, per_node: int | None = None
) -> list[StepPrediction]:
    """The run at each world size, with the same ranks per node."""
    return [predict(at_world_size(request, world), hardware, costs, per_node=per_node) for world in world_sizes]


def _shardings(request: PlanRequest, ranks_per_node: int) -> Iterator[ShardingConfig]:
    world, base = request.world_size, request.sharding
    groups = sorted({g for g in (2, 4, 8, 16, 32, 64, ranks_per_node) if 1 < g < world and world % g == 0})
    strategies: list[tuple[Strategy, int | None]] = [(Strategy.FULL, None), (Strategy.GRAD_OP, None), (Strategy.NONE, None)]
    strategies += [(Strategy.HYBRID, group) for group in groups]
    for (strategy, group), prefetch, forward, limit, checkpointing in itertools.product(
        strategies, tuple(BackwardPrefetch), (False, True), (2, 0), (False, True)
    ):
        yield dataclasses.replace(
            base,
            strategy=strategy,
            shard_group_size=group,
            backward_prefetch=prefetch,
            forward_prefetch=forward,
            limit_all_gathers=limit,
            activation_checkpointing=checkpointing,
        )


def recommend(
    request: PlanRequest, hardware: Hardware, costs: ModelCosts, *, per_node: int | None = None, top: int = 5
) -> list[StepPrediction]:
    """The `top` fastest configurations that fit the device's memory, fastest first: strategy,
    shard group size, prefetch, limiter, activation checkpointing and micro-batch size (grad
    accum at the same global batch). The engine gathers in the compute dtype only."""
    world = request.world_size
    per_node = min(per_node or hardware.ranks_per_node, world)
    accums = [a for a in (1, 2, 4, 8, 16) if request.global_batch_size % (world * a) == 0]
    found = []
    for sharding, accum in itertools.product(_shardings(request, per_node), accums):
        candidate = dataclasses.replace(request, sharding=sharding, grad_accum=accum, no_sync=request.no_sync and accum > 1)
        prediction = predict(candidate, hardware, costs, per_node=per_node)
        if prediction.fits:
            found.append(prediction)
    found.sort(key=lambda p: p.time.step_time_s)
    return found[:top]
