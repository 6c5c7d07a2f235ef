"""Snapshots in a training run (checkpoint/memory does the work): the store the launcher owns,
the writer each worker keeps, and the restore of a restarted attempt.

The launcher makes the node's store before the workers start and removes it when the run ends,
whatever ends it; a worker the elastic agent restarts finds it through the RunContext. Stale
stores of dead runs are reclaimed first. Snapshots are taken only when a restart can use them
(--max-restarts > 0, launched by fsdpkit train: under torchrun there is no launcher to own them).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import log
from ..checkpoint.memory.store import DEFAULT_ROOT, SnapshotStore, reclaim_stale, room_line
from ..checkpoint.memory.writer import Peers, SnapshotWriter, local_world_size
from .config import Optimizer, TrainConfig

SLOTS = 2


def needed_bytes(config: TrainConfig, num_params: int) -> int:
    """Shared memory one node's store needs: two slots of its ranks' fp32 shards with their
    optimizer state, and as much again for the buddies' copies with several nodes."""
    optimizer = config.optimizer
    states = 2 if optimizer.name is Optimizer.ADAMW else (1 if optimizer.momentum else 0)
    bytes_per_param = 4 * (1 + states)
    launch, sharding = config.launch, config.sharding
    strategy = str(getattr(sharding.strategy, "value", sharding.strategy))
    shard_factor = {"none": 1, "hybrid": sharding.shard_group_size or launch.world_size}.get(strategy, launch.world_size)
    per_rank = -(-num_params * bytes_per_param // shard_factor)
    return SLOTS * per_rank * launch.local_processes * (2 if launch.nnodes > 1 else 1)


def wanted(config: TrainConfig) -> bool:
    return bool(config.checkpoint.snapshot_every) and config.launch.max_restarts > 0


@contextlib.contextmanager
def snapshot_store(config: TrainConfig, run_id: str | None, num_params: int) -> Iterator[str | None]:
    """The path of this node's new store, removed when the block ends; None (and one warning
    line when shared memory is too small) when the run takes no snapshots."""
    if not wanted(config):
        yield None
        return
    reclaim_stale(DEFAULT_ROOT)
    line = room_line(DEFAULT_ROOT, needed_bytes(config, num_params))
    store = None
    if line is None:
        run = run_id or (f"rdzv-{config.launch.job_id}" if config.launch.nnodes > 1 else f"run-{uuid.uuid4().hex[:12]}")
        try:
            store = SnapshotStore.create(DEFAULT_ROOT, run_id=run, node_rank=config.launch.node_rank)
        except OSError as error:
            line = f"snapshots off: cannot create a store in {DEFAULT_ROOT} ({error.strerror}); checkpoints on disk only"
    if line is not None:
        log.warn(line)
    try:
        yield str(store.path) if store else None
    finally:
        if store is not None:
            store.remove()


def open_writer(store_path: str | None, config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer) -> SnapshotWriter | None:
    """This worker's snapshot writer (every rank calls it: with several nodes it makes a group)."""
    if not wanted(config):
        return None
    peers = Peers.of(dist.get_rank(), dist.get_world_size(), local_world_size())
    return SnapshotWriter(SnapshotStore(store_path), model, optimizer, peers=peers, warn=log.warn) if store_path else None
