"""A load whose storage reads the replicas share (hybrid or no sharding; docs/faults.md): the
first replica reads from storage and broadcasts what it read to its replicate group.

A load runs twice through the same code: first against `Requests`, which hands out
uninitialised tensors and records each range asked for, then against the ranges themselves,
served in the same order. Every rank of a replicate group holds the same fragments, so it asks
for the same ranges in the same order: the first replica reads them into one buffer, and one
broadcast carries it (not one per tensor: each costs a latency step per rank). The buffer
starts with a header that holds the first replica's error when its read failed: every replica
then fails with it at once, rather than wait for a broadcast until the timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...dist.comm import Collectives
from ...dtypes import dtype_info
from ...engine.view import ShardedModelView
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from .tensors import CheckpointReader, RangeReader, byte_view

ALIGN = 16  # each range starts at a multiple of this in the broadcast buffer
HEADER_BYTES = 1024  # before the ranges: the first replica's error (UTF-8), or zeros


@dataclass(frozen=True)
class Request:
    name: str
    wanted: ElementRange
    dtype: torch.dtype
    shape: tuple[int, ...] | None  # a whole tensor's shape; None for a range (1-D)
    at: int  # where it starts in the broadcast buffer

    @property
    def nbytes(self) -> int:
        return self.wanted.size * self.dtype.itemsize


class Requests:
    """Records what a load asks for; hands out uninitialised tensors of the right size."""

    def __init__(self, checkpoint: CheckpointReader) -> None:
        self.checkpoint = checkpoint
        self.asked: list[Request] = []
        self.total = HEADER_BYTES

    def read_tensor(self, name: str) -> torch.Tensor:
        source = self.checkpoint.source(name)
        return self.read_range(name, ElementRange(0, source.numel), tuple(source.shape))

    def read_range(self, name: str, wanted: ElementRange, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        request = Request(name, wanted, dtype_info(self.checkpoint.source(name).dtype).torch, shape, self.total)
        self.asked.append(request)
        self.total += -(-request.nbytes // ALIGN) * ALIGN
        out = torch.empty(wanted.size, dtype=request.dtype)
        return out if shape is None else out.reshape(shape)


class Served:
    """The recorded ranges, out of the broadcast buffer, asked for again in the same order."""

    def __init__(self, asked: list[Request], buffer: torch.Tensor) -> None:
        self.asked, self.buffer = asked, buffer
        self.next = 0

    def read_tensor(self, name: str) -> torch.Tensor:
        request = self.asked[self.next]
        return self.read_range(name, request.wanted).reshape(request.shape if request.shape is not None else (-1,))

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        request = self.asked[self.next]
        if (request.name, request.wanted) != (name, wanted):
            raise AssertionError(f"a shared load asked for {name} {wanted} where it first asked for {request.name} {request.wanted}")
        self.next += 1
        return self.buffer[request.at : request.at + request.nbytes].view(request.dtype).clone()  # the buffer is freed after the load


def shared_load(checkpoint: CheckpointReader, view: ShardedModelView, comms: Collectives, load: Callable[[RangeReader], None]) -> None:
    """Run `load` (which reads through the reader it is given) with its reads shared by the
    replicas: recorded, read on the first replica, broadcast over each replicate group, served."""
    requests = Requests(checkpoint)
    load(requests)
    if not requests.asked:  # nothing to read: no buffer, no broadcast
        load(Served([], torch.empty(0, dtype=torch.uint8)))
        return
    buffer = torch.zeros(requests.total, dtype=torch.uint8)
    failure = None
    try:
        for request in requests.asked if view.writes_shards else ():
            if request.wanted.size:
                into = byte_view(buffer[request.at : request.at + request.nbytes])
                into[:] = byte_view(checkpoint.read_range(request.name, request.wanted))
    except (DataCheckError, OSError) as error:  # into the header: every replica fails with it, once it has the broadcast
        failure = error if isinstance(error, DataCheckError) else DataCheckError(f"{checkpoint.step_dir}: {error}")
        message = str(failure).encode()[: HEADER_BYTES - 1]
        buffer[: len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    buffer = buffer.to(view.device)
    first_replica = dist.get_global_rank(view.group, view.rank % view.shard_factor)  # this group's rank there
    comms.broadcast(buffer, first_replica, view.replicate_group, label="load")
    if failure is not None:
        raise failure
    header = bytes(buffer[:HEADER_BYTES].cpu().numpy()).rstrip(b"\0")
    if header:
        raise DataCheckError(header.decode(errors="replace"))
    load(Served(requests.asked, buffer))
