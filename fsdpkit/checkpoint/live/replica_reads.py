"""A load whose storage reads the replicas share (hybrid or no sharding, R copies of each
shard): each element range a replicate group needs is read from storage by one of its ranks
and broadcast to the others over the replicate group, so storage serves each byte once per
load instead of R times.

The reading rank of a replicate group is the one on replica `shard_rank % R`: the groups of
one shard group read on different replicas (nodes), which spreads the storage traffic, and
each rank file is read by one rank only. Every rank of a replicate group holds the same
fragments, so it asks for the same ranges in the same order: one broadcast per range lines
up on all of them, and the receivers know each range's size and dtype from the manifest.

A tensor stored whole (a scalar optimizer state, a buffer) is needed by every rank: it is
read by the rank that reads the file holding it anyway (saved rank file t belongs to shard
rank t * F // W_saved) and broadcast over the whole data-parallel group, in the order every
rank asks for it. No other rank touches that file, so no storage read-ahead pulls it in twice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...dist.comm import Collectives
from ...dtypes import dtype_info
from ...engine.view import ShardedModelView
from ...flat_layout import ElementRange
from .tensors import CheckpointReader, RangeReader


class ReplicaReads:
    """`checkpoint`'s ranges, read on one rank of this rank's replicate group and broadcast to
    the others, and its whole tensors read on one rank and broadcast to all (on `view.device`:
    NCCL broadcasts device tensors). Every rank must make the same calls in the same order."""

    def __init__(self, checkpoint: CheckpointReader, view: ShardedModelView, comms: Collectives) -> None:
        if view.replicate_group is None:
            raise ValueError(f"rank {view.rank} has no replicate group to share a load's reads with ({view.replicas} replica)")
        self.checkpoint = checkpoint
        self.comms = comms
        self.view = view
        reading = view.shard_rank % view.replicas
        self.reads = view.replica == reading
        self.source = dist.get_global_rank(view.replicate_group, reading)
        self.file_index = {name: index for index, name in enumerate(checkpoint.checkpoint.file_names())}

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        return self._shared(name, wanted, self.reads, self.source, self.view.replicate_group)

    def read_tensor(self, name: str) -> torch.Tensor:
        source = self.checkpoint.source(name)
        if not source.numel:
            return self.checkpoint.read_tensor(name).to(self.view.device)
        saved_file = self.file_index[source.pieces_in(ElementRange(0, source.numel))[0].path.name]
        shard_rank = saved_file * self.view.shard_factor // len(self.file_index)
        holder = (shard_rank % self.view.replicas) * self.view.shard_factor + shard_rank  # its reader, in the data-parallel group
        data = self._shared(
            name, ElementRange(0, source.numel), self.view.rank == holder, dist.get_global_rank(self.view.group, holder), self.view.group
        )
        return data.reshape(source.shape)

    def _shared(self, name: str, wanted: ElementRange, reads: bool, source: int, group: Any) -> torch.Tensor:
        if reads:
            data = self.checkpoint.read_range(name, wanted).to(self.view.device)
        else:
            data = torch.empty(wanted.size, dtype=dtype_info(self.checkpoint.source(name).dtype).torch, device=self.view.device)
        if wanted.size:
            self.comms.broadcast(data.view(torch.uint8), source, group, label="load")  # bytes: any dtype, bool too
        return data


def range_reader(reader: CheckpointReader, view: ShardedModelView, comms: Collectives, *, every_replica: bool) -> RangeReader:
    """What a load of `view` reads through: `reader` itself on every rank (one replica, or
    `every_replica`: a store local to each node, such as shared memory), else ReplicaReads."""
    if every_replica or view.replicate_group is None:
        return reader
    return ReplicaReads(reader, view, comms)
