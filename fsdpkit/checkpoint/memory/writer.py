"""Taking snapshots (what and why: docs/faults.md): every K steps each rank copies its part of a
checkpoint to host memory (copy_order.py), and a thread writes its rank file and then its header
into the node's store, and with several nodes trades files with its buddy (`Peers`). A rank writes
step S only after every rank has finished the previous snapshot (`finished_flag`, summed over the
ranks in the step's loss all-reduce, then `confirm`), and first removes its own files older than
that one: two slots, one of which every rank has complete.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...dist import faults
from ...dist.comm import new_group
from ...engine.view import describe
from ..format.manifest import Manifest
from ..format.names import MANIFEST_NAME
from ..format.writer import CacheMode
from ..live.checkpointer import manifest_of
from ..live.copy_order import Event, OverlappedCopy
from ..live.model_state import persistent_buffers, tensor_table
from ..live.save_protocol import write_rank
from ..live.tensors import byte_view
from .store import SnapshotHeader, SnapshotStore

MAX_PARTS = 3


@dataclass(frozen=True)
class Peers:
    """Who sends this rank's snapshot where: to `buddy` (this rank + the local world size, on
    the next node), and receives from `source`; global ranks, on `group`."""

    buddy: int
    source: int
    group: Any

    @classmethod
    def of(cls, rank: int, world_size: int, local_world_size: int) -> Peers | None:
        """None on one node. Every rank calls it: making the group is a collective."""
        if world_size <= local_world_size:
            return None
        return cls((rank + local_world_size) % world_size, (rank - local_world_size) % world_size, new_group(backend="gloo"))


class SnapshotWriter:
    """This rank's snapshots into `store`. `warn`: where the one line of a failed write, or of
    a skipped snapshot (rank 0's), goes; `stall_seconds` sums the training thread's time in `offer`."""

    def __init__(
        self,
        store: SnapshotStore,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        peers: Peers | None,
        warn: Callable[[str], None],
    ) -> None:
        self.store = store
        self.module = module
        self.optimizer = optimizer
        self.peers = peers
        self.warn = warn
        view = describe(module)
        self.shard_rank, self.shard_factor = view.shard_rank, view.shard_factor
        self.copy = OverlappedCopy.reserved(view, module, optimizer)
        self.host_buffers = self.copy.buffers
        self.thread: threading.Thread | None = None
        self.failed = False
        self.pending: int | None = None  # the step of the last snapshot started
        self.confirmed: int | None = None  # the newest step every rank has finished
        self.copies: set[int] = set()  # the rank files this rank keeps copies of (its source's)
        self.stall_seconds = 0.0

    def finished_flag(self) -> float:
        """1 when this rank has nothing in flight (or has given up), for the ranks' sum."""
        return 0.0 if self.thread is not None and self.thread.is_alive() else 1.0

    def confirm(self, finished: float, world_size: int) -> None:
        if self.pending is not None and round(finished) == world_size:
            self.confirmed = self.pending

    def offer(self, step: int, training_state: dict) -> None:
        """Snapshot `step` if the previous snapshot is done on every rank: queue the copy now, write
        in the background; else skip it, in one line."""
        started = time.perf_counter()
        try:
            if self.pending is not None and self.pending != self.confirmed:  # the same on every rank
                if dist.get_rank() == 0:
                    self.warn(f"snapshot of step {step} skipped: the one of step {self.pending} is not finished on every rank yet")
                return
            self.pending = step
            staged = None
            if not self.failed:
                view = describe(self.module)
                table, local = tensor_table(view, self.module, self.optimizer)
                buffers = frozenset(persistent_buffers(self.module))
                host, copied = self.copy.start({name: data for name, (_, data) in local.items()}, on_training=buffers)
                manifest = manifest_of(view, self.module, self.optimizer, table, training_state, self.store.run_id, step)
                staged = manifest, {name: (held, host[name]) for name, (held, _) in local.items()}, copied
            elif self.peers is None:
                return
            self.thread = threading.Thread(target=self._write, args=(step, staged), name="fsdpkit-snapshot", daemon=True)
            self.thread.start()
        finally:
            self.stall_seconds += time.perf_counter() - started

    def _write(self, step: int, staged: tuple[Manifest, dict, Event] | None) -> None:
        """Prune, wait for the copy, write (`staged` None: this rank gave up), then trade files with
        the peers; at the thread's own priority: a write to memory is short, a slow one skips the next."""
        header = None
        if staged is not None:
            manifest, local, copied = staged
            try:
                if self.confirmed is not None:
                    for rank in {self.shard_rank, *self.copies}:  # its own files and the copies it keeps of its source's
                        self.store.prune_rank(rank, self.shard_factor, keep_from=self.confirmed)
                copied.synchronize()
                faults.reached("snapshot", step)
                directory = self.store.begin(step, manifest.to_bytes())
                crc = write_rank(directory, manifest, self.shard_rank, local, cache=CacheMode.CACHED)  # tmpfs: memory already
                header = self.store.finish(step, self.shard_rank, self.shard_factor, crc)
            except OSError as error:
                self.failed = True
                self.store.discard(step, self.shard_rank, self.shard_factor)  # not the step: others write into it
                self.warn(
                    f"snapshot of step {step} not taken ({error.strerror or error}); this rank takes no more, checkpoints on disk only"
                )
        if self.peers is not None:
            self._exchange(self.peers, header)

    def _exchange(self, peers: Peers, header: SnapshotHeader | None) -> None:
        """Send this rank's file (if any) to its buddy, and keep the one its source sends."""
        parts = [] if header is None else [header.to_bytes(), self.store.read(header.step, header.rank, header.world_size)[1]]
        sent = send_parts(parts, peers.buddy, peers.group)
        received = receive_parts(peers.source, peers.group)
        for work in sent:
            work.wait()
        if received:
            copy = SnapshotHeader.from_bytes(received[0])
            try:
                if (self.store.step_dir(copy.step) / MANIFEST_NAME).is_file():  # this node's ranks wrote the step's manifest
                    self.store.put(copy, received[1])
                    self.copies.add(copy.rank)
            except OSError as error:
                self.warn(f"the copy of rank file {copy.rank} of step {copy.step} not kept ({error.strerror or error})")

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def send_parts(parts: list[bytes], to: int, group: Any) -> list:
    """Start sending byte strings (none: nothing to send) to global rank `to`; the works to wait for."""
    sizes = torch.tensor([len(parts), *(len(part) for part in parts)] + [0] * (MAX_PARTS - len(parts)), dtype=torch.int64)
    works = [dist.isend(sizes, to, group=group)]
    if parts:
        works.append(dist.isend(torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8), to, group=group))
    return works


def receive_parts(source: int, group: Any) -> list[memoryview]:
    """What global rank `source` sends with send_parts."""
    sizes = torch.empty(1 + MAX_PARTS, dtype=torch.int64)
    dist.recv(sizes, source, group=group)
    count, *lengths = (int(v) for v in sizes.tolist())
    if count == 0:
        return []
    body = torch.empty(sum(lengths), dtype=torch.uint8)
    dist.recv(body, source, group=group)
    raw, ends = byte_view(body), list(accumulate(lengths[:count]))
    return [raw[end - length : end] for length, end in zip(lengths[:count], ends, strict=True)]


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
