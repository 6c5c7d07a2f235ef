"""One benchmarked collective at one size: its buffers, the call, and what --check expects.

Modes follow nccl-tests. Out-of-place: separate send and receive buffers. In-place: the
send buffer lives inside the receive buffer (all-gather: at rank * count in the output;
reduce-scatter: the output is chunk `rank` of the input). torch's all_reduce and broadcast
exist only in place, and all_to_all_single is only benchmarked out of place (NCCL cannot
run it in place), so those modes are reported as N/A instead of timing a copy as well.

All-gather has three variants: `flat` (one output tensor, all_gather_single, what FSDP uses),
`list` (dist.all_gather into a list of separate tensors) and `fsdpkit` (what the engine runs:
fsdpkit.dist.comm.Collectives.all_gather, point-to-point transfers into place where the backend is
gloo, the native collective elsewhere). Reduce-scatter has two: `torch`
(reduce_scatter_single; gloo runs it as an all-reduce) and `fsdpkit` (what the engine runs:
fsdpkit.dist.comm.Collectives.reduce_scatter, point-to-point transfers and a local sum where the
backend has no reduce-scatter, the native collective elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ..dist.comm import Collectives, all_gather_flat, reduce_scatter_flat
from . import patterns


@dataclass(frozen=True)
class PreparedCollective:
    """Buffers allocated, inputs filled. `run` issues the collective once."""

    run: Callable[[], None]
    reset: Callable[[], None]  # refill the inputs (the timed runs overwrite in-place buffers)
    result: Callable[[], torch.Tensor]  # this rank's output, flat
    expected: Callable[[], torch.Tensor]  # what `result` must equal (float64)
    rtol: float = 0.0


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    dtype: torch.dtype
    device: torch.device
    group: Any


def supports_mode(collective: str, mode: str) -> bool:
    if collective in ("allreduce", "broadcast"):
        return mode == "in_place"
    if collective == "alltoall":
        return mode == "out_of_place"
    return True


REDUCE_OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}


def prepare(collective: str, variant: str, mode: str, count: int, where: RankContext, *, op: str = "sum") -> PreparedCollective:
    """Allocate buffers for `collective` with `count` elements (per rank for the sharded ones);
    `op` is the reduction of all-reduce and reduce-scatter."""
    if not supports_mode(collective, mode):
        raise ValueError(f"{collective} has no {mode} form")
    in_place = mode == "in_place"
    if collective == "reducescatter":
        return _prepare_reducescatter(in_place, count, where, op, engine=variant == "fsdpkit")
    if collective == "allreduce":
        return _prepare_allreduce(in_place, count, where, op)
    builders = {
        "allgather": _prepare_allgather_list if variant == "list" else partial(_prepare_allgather_flat, engine=variant == "fsdpkit"),
        "broadcast": _prepare_broadcast,
        "alltoall": _prepare_alltoall,
    }
    return builders[collective](in_place, count, where)


def _empty(numel: int, where: RankContext) -> torch.Tensor:
    return torch.empty(numel, dtype=where.dtype, device=where.device)


def _prepare_allgather_flat(in_place: bool, count: int, where: RankContext, *, engine: bool = False) -> PreparedCollective:
    """torch's all_gather_single, or (engine) the engine's Collectives.all_gather."""
    rank, n = where.rank, where.world_size
    comms = Collectives()
    output = _empty(count * n, where)
    shard = output[rank * count : (rank + 1) * count] if in_place else _empty(count, where)

    def reset() -> None:
        output.zero_()
        shard.copy_(patterns.moved_values(rank, count, dtype=where.dtype, device=where.device))

    reset()
    return PreparedCollective(
        run=(lambda: comms.all_gather(output, shard, where.group))
        if engine
        else (lambda: all_gather_flat(output, shard, group=where.group)),
        reset=reset,
        result=lambda: output,
        expected=lambda: patterns.gathered_values(n, count, device=where.device),
    )


def _prepare_allgather_list(in_place: bool, count: int, where: RankContext) -> PreparedCollective:
    rank, n = where.rank, where.world_size
    if in_place:
        flat = _empty(count * n, where)
        outputs = list(flat.chunk(n))
        shard = outputs[rank]
    else:
        outputs = [_empty(count, where) for _ in range(n)]
        shard = _empty(count, where)

    def reset() -> None:
        for output in outputs:
            output.zero_()
        shard.copy_(patterns.moved_values(rank, count, dtype=where.dtype, device=where.device))

    reset()
    return PreparedCollective(
        run=lambda: dist.all_gather(outputs, shard, group=where.group),
        reset=reset,
        result=lambda: torch.cat(outputs),
        expected=lambda: patterns.gathered_values(n, count, device=where.device),
    )


def _prepare_reducescatter(in_place: bool, count: int, where: RankContext, op: str, *, engine: bool) -> PreparedCollective:
    """torch's reduce_scatter_single, or (engine) the engine's Collectives.reduce_scatter (sum only)."""
    rank, n = where.rank, where.world_size
    comms = Collectives()
    full = _empty(count * n, where)
    output = full[rank * count : (rank + 1) * count] if in_place else _empty(count, where)

    def reset() -> None:
        output.zero_()
        full.copy_(patterns.summed_values(rank, 0, count * n, dtype=where.dtype, device=where.device))

    reset()
    return PreparedCollective(
        run=(lambda: comms.reduce_scatter(output, full, where.group))
        if engine
        else (lambda: reduce_scatter_flat(output, full, op=getattr(dist.ReduceOp, REDUCE_OPS[op]), group=where.group)),
        reset=reset,
        result=lambda: output,
        expected=lambda: patterns.reduced_over_ranks(op, rank * count, count, n, device=where.device),
        rtol=patterns.tolerance(where.dtype, n, op),
    )


def _prepare_allreduce(in_place: bool, count: int, where: RankContext, op: str) -> PreparedCollective:
    rank, n = where.rank, where.world_size
    buffer = _empty(count, where)

    def reset() -> None:
        buffer.copy_(patterns.summed_values(rank, 0, count, dtype=where.dtype, device=where.device))

    reset()
    return PreparedCollective(
        run=lambda: dist.all_reduce(buffer, op=getattr(dist.ReduceOp, REDUCE_OPS[op]), group=where.group),
        reset=reset,
        result=lambda: buffer,
        expected=lambda: patterns.reduced_over_ranks(op, 0, count, n, device=where.device),
        rtol=patterns.tolerance(where.dtype, n, op),
    )


def _prepare_broadcast(in_place: bool, count: int, where: RankContext) -> PreparedCollective:
    root = dist.get_global_rank(where.group, 0)
    buffer = _empty(count, where)

    def reset() -> None:
        if where.rank == 0:
            buffer.copy_(patterns.moved_values(0, count, dtype=where.dtype, device=where.device))
        else:
            buffer.zero_()

    reset()
    return PreparedCollective(
        run=lambda: dist.broadcast(buffer, src=root, group=where.group),
        reset=reset,
        result=lambda: buffer,
        expected=lambda: patterns.moved_values(0, count, dtype=torch.float64, device=where.device),
    )


def _prepare_alltoall(in_place: bool, count: int, where: RankContext) -> PreparedCollective:
    rank, n = where.rank, where.world_size
    send = _empty(count * n, where)
    receive = _empty(count * n, where)

    def reset() -> None:
        receive.zero_()
        send.copy_(patterns.alltoall_input(rank, n, count, dtype=where.dtype, device=where.device))

    reset()
    return PreparedCollective(
        run=lambda: dist.all_to_all_single(receive, send, group=where.group),
        reset=reset,
        result=lambda: receive,
        expected=lambda: patterns.alltoall_expected(rank, n, count, device=where.device),
    )
