"""The one compatibility layer for the collectives FSDP needs.

torch >= 2.13 names the flat collectives `all_gather_single` / `reduce_scatter_single`; older
releases `all_gather_into_tensor` / `reduce_scatter_tensor`. Every collective fsdpkit issues
(engine, gradient clipping, grad scaler, checkpoint I/O) goes through `Collectives`, which
also counts calls and bytes (so tests can check what each sharding strategy sends) and can
record events in order.

Where gloo serves the tensors (CPU), the engine's all-gather and reduce-scatter are
point-to-point transfers posted from the calling thread: each rank sends its shard (or
chunk p of its gradient) straight to every other rank, which receives it in place (the
all-gather's output; for the reduce-scatter the output itself, then adds its own chunk).
Each rank sends (W-1)/W of the tensor, as a ring would, with no staging buffer and none of
the copies gloo's collectives make (its all_gather gathers into a new flat tensor and
copies out; torch's reduce-scatter on gloo is an all-reduce of the whole tensor, twice the
traffic). Both ranks' transfers of one collective are matched in issue order (one tag per
kind), so they are asynchronous and ordered like every collective. NCCL keeps torch's
collectives. `fsdpkit bench allgather reducescatter --variant all` compares.

`all_gather_encoded` wraps the all-gather in a codec (the engine's int8 weight gather):
encode this rank's chunk into a byte row, gather the rows, decode them into the output.

A collective that fails (gloo: it timed out after the process group's timeout, or a peer
closed its connection) raises `CollectiveError` naming the collective and its label, whether
it failed when issued or when its work handle is waited on. `new_group` makes groups with
the default group's timeout (torch's own default for a new group is 30 minutes).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import faults

all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_GATHER_TAG, _SCATTER_TAG = 1, 2  # point-to-point tags: transfers of one kind match in issue order


@dataclass
class CommStats:
    """Calls and bytes per collective kind, for one engine instance (never global)."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    events: list[tuple[str, str]] | None = None  # (kind, label) in issue order, when recording

    def add(self, kind: str, num_bytes: int, label: str = "") -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + num_bytes
        if self.events is not None:
            self.events.append((kind, label))

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        if self.events is not None:
            self.events.clear()


class RowCodec(Protocol):
    """Turns one rank's chunk into a fixed-size byte row and every rank's rows back into the
    full tensor (fsdpkit.engine.quant.Int8BlockCodec)."""

    @property
    def row_bytes(self) -> int: ...

    def encode(self, chunk: torch.Tensor) -> torch.Tensor: ...

    def decode(self, rows: torch.Tensor, out: torch.Tensor) -> None: ...


class _ThenWork:
    """A work handle that runs `finish` once, after the collective it wraps completed."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self.work = work
        self.finish: Callable[[], None] | None = finish

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            finish, self.finish = self.finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self.finish is None


class CollectiveError(RuntimeError):
    """A collective that did not complete: which one (`kind`, `label`) and what the backend said."""

    def __init__(self, kind: str, label: str, reason: str) -> None:
        self.kind = kind
        self.label = label
        self.reason = reason
        super().__init__(f"{kind}{f' ({label})' if label else ''} failed: {reason}")

    @property
    def timed_out(self) -> bool:
        return "timed out" in self.reason.lower() or "timeout" in self.reason.lower()


class _Watched:
    """A work handle whose failure is a CollectiveError naming its collective."""

    def __init__(self, work: Any, kind: str, label: str) -> None:
        self.work = work
        self.kind = kind
        self.label = label

    def wait(self) -> bool:
        try:
            self.work.wait()
        except RuntimeError as error:
            raise CollectiveError(self.kind, self.label, _first_line(error)) from error
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


def _first_line(error: BaseException) -> str:
    """The backend's message without its source location or advice: gloo says
    '[.../pair.cc:553] Connection closed by peer [127.0.0.1]:58006. This is typically ...'."""
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return line.split(". ", 1)[0].rstrip(".")


class Collectives:
    """Collectives on explicit process groups, counted in `stats`."""

    def __init__(self, stats: CommStats | None = None) -> None:
        self.stats = stats if stats is not None else CommStats()

    def _issue(self, kind: str, num_bytes: int, label: str, call: Any, async_op: bool) -> Any:
        self.stats.add(kind, num_bytes, label)
        faults.before_collective(kind, label)
        try:
            work = call()
            if async_op:
                return _Watched(work, kind, label) if work is not None else None
            return work
        except RuntimeError as error:
            raise CollectiveError(kind, label, _first_line(error)) from error

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, group: Any, *, async_op: bool = False, label: str = ""):
        """Concatenate every rank's equal `shard` into `output` (numel = shard.numel * group size)."""
        return self._issue(
            "all_gather",
            output.numel() * output.element_size(),
            label,
            lambda: (
                all_gather_by_p2p(output, shard, group, async_op=async_op)
                if is_gloo(output, group)
                else all_gather_flat(output, shard, group=group, async_op=async_op)
            ),
            async_op,
        )

    def all_gather_encoded(
        self, output: torch.Tensor, shard: torch.Tensor, group: Any, codec: RowCodec, *, async_op: bool = False, label: str = ""
    ):
        """all_gather through `codec`: this rank's shard is encoded into a byte row, the rows
        are gathered (counted as the all-gather's bytes) and decoded into `output`; when
        asynchronous, the decoding runs in the handle's wait()."""
        rows = torch.empty(output.numel() // shard.numel() * codec.row_bytes, dtype=torch.uint8, device=shard.device)
        work = self.all_gather(rows, codec.encode(shard), group, async_op=async_op, label=label)

        def decode() -> None:
            if rows.is_cuda:  # gathered on a prefetch stream, decoded on the current one
                rows.record_stream(torch.cuda.current_stream(rows.device))
            codec.decode(rows, output)

        handle = _ThenWork(work, decode)
        if async_op:
            return handle
        handle.wait()
        return None

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, group: Any, *, async_op: bool = False, label: str = ""):
        """Sum `full` over the group and leave chunk `rank` of the sum in `output`.

        Returns a work handle when asynchronous: `output` holds the result after `wait()`.
        """

        def call():
            if is_gloo(full, group):
                return reduce_scatter_by_p2p(output, full, group, async_op=async_op)
            return reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)

        return self._issue("reduce_scatter", full.numel() * full.element_size(), label, call, async_op)

    def all_reduce(self, tensor: torch.Tensor, group: Any, *, op: Any = dist.ReduceOp.SUM, async_op: bool = False, label: str = ""):
        return self._issue(
            "all_reduce",
            tensor.numel() * tensor.element_size(),
            label,
            lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
            async_op,
        )

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any, *, async_op: bool = False, label: str = ""):
        return self._issue(
            "broadcast",
            tensor.numel() * tensor.element_size(),
            label,
            lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
            async_op,
        )

    def broadcast_object(self, value: Any, src: int, group: Any, *, label: str = "") -> Any:
        """`value` of rank `src` (a rank of `group`, not a global rank) on every rank."""
        holder = [value]
        self._issue(
            "broadcast_object",
            0,
            label,
            lambda: dist.broadcast_object_list(holder, src=dist.get_global_rank(group, src) if group is not None else src, group=group),
            False,
        )
        return holder[0]

    def all_gather_object(self, value: Any, group: Any, *, label: str = "") -> list[Any]:
        """Every rank's `value`, in group rank order."""
        values: list[Any] = [None] * dist.get_world_size(group)
        self._issue("all_gather_object", 0, label, lambda: dist.all_gather_object(values, value, group=group), False)
        return values


def group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The timeout `group` (default: the default group) was made with; None where torch does not say."""
    group = group if group is not None else dist.group.WORLD
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def new_group(ranks: list[int] | None = None, *, backend: str | None = None) -> Any:
    """dist.new_group with the default group's timeout, so that no collective waits longer than it."""
    return dist.new_group(ranks, timeout=group_timeout(), backend=backend)


def is_gloo(tensor: torch.Tensor, group: Any) -> bool:
    """True where gloo serves `tensor`'s device in `group`."""
    backend = dist.get_backend(group)
    return backend == "gloo" or (tensor.device.type == "cpu" and "cpu:gloo" in backend)


class _PointToPointWork:
    """The work handle of a collective made of point-to-point transfers: wait() waits for
    every transfer, then runs `finish` (the local sum of a reduce-scatter)."""

    def __init__(self, works: list[Any], finish: Callable[[], None] | None = None) -> None:
        self.works = works
        self.finish = finish
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            for work in self.works:
                work.wait()
            if self.finish is not None:
                self.finish()
            self.works, self.finish, self.done = [], None, True
        return True

    def is_completed(self) -> bool:
        return self.done


def _group_of(group: Any) -> Any:
    return group if group is not None else dist.group.WORLD


def all_gather_by_p2p(output: torch.Tensor, shard: torch.Tensor, group: Any, *, async_op: bool = False):
    """Every rank sends its shard straight to every other rank, which receives it into its
    place in `output`: no staging buffer, no copy besides this rank's own chunk (none when
    `shard` is that chunk already)."""
    group = _group_of(group)
    rank, size = group.rank(), group.size()
    chunks = output.view(size, -1)
    if chunks[rank].data_ptr() != shard.data_ptr():
        chunks[rank].copy_(shard)
    works = []
    for step in range(1, size):
        works.append(group.send([shard], (rank + step) % size, _GATHER_TAG))
        works.append(group.recv([chunks[(rank - step) % size]], (rank - step) % size, _GATHER_TAG))
    handle = _PointToPointWork(works)
    if async_op:
        return handle
    handle.wait()
    return None


def reduce_scatter_by_p2p(output: torch.Tensor, full: torch.Tensor, group: Any, *, async_op: bool = False):
    """Chunk p of every rank's `full` goes straight to rank p, which sums what it receives
    with its own chunk. Each rank sends and receives (W-1)/W of the tensor. The first chunk
    received lands in `output` itself, so the buffer holds W-2 chunks (none at two ranks,
    where the sum of two terms is bitwise an all-reduce's); when `output` is this rank's
    chunk of `full` (in place) every received chunk is buffered."""
    group = _group_of(group)
    rank, size = group.rank(), group.size()
    chunks = full.view(size, -1)
    in_place = output.data_ptr() == chunks[rank].data_ptr()
    if size == 1:
        if not in_place:
            output.copy_(full)
        return _PointToPointWork([]) if async_op else None
    extra = torch.empty((size - 1 if in_place else size - 2, chunks.shape[1]), dtype=full.dtype, device=full.device)
    targets = list(extra) if in_place else [output, *extra]
    works = []
    for step, target in enumerate(targets, start=1):
        works.append(group.send([chunks[(rank + step) % size]], (rank + step) % size, _SCATTER_TAG))
        works.append(group.recv([target], (rank - step) % size, _SCATTER_TAG))

    def add_own_and_others() -> None:
        if not in_place:
            output.add_(chunks[rank])
        for row in extra:
            output.add_(row)

    handle = _PointToPointWork(works, add_own_and_others)
    if async_op:
        return handle
    handle.wait()
    return None
