"""Restoring a restarted group from its snapshots, every rank taking part.

1. Each rank verifies its share of the rank files in its node's store (local rank i the files
   i, i + L, ...: each file read once per node), one line for each it refuses (another run's,
   another world size, a checksum mismatch; a file torn by the kill is skipped silently).
2. One all-gather of what every rank holds and needs; every rank then computes the same
   `choose` (choice.py): the newest step every rank can restore, or disk.
3. Files a node lacks come from a rank of another node that holds them (`peer`).
4. Each rank loads the chosen step from its node's store, through the checkpoint reader (every
   fragment's crc32 checked again as it is read).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ...dist.comm import Collectives
from ...engine.view import describe
from ..format.manifest import load_manifest
from ..format.names import MANIFEST_NAME
from ..live.checkpointer import Checkpointer
from .choice import Choice, Source, choose
from .store import SnapshotHeader, SnapshotStore
from .writer import local_world_size, receive_parts, send_parts


def verified_files(
    store: SnapshotStore, world_size: int, *, local_rank: int, local_world: int, warn: Callable[[str], None]
) -> dict[int, list[int]]:
    """{step: this rank's share of the store's rank files that can be restored}."""
    held: dict[int, list[int]] = {}
    for step in store.steps():
        for file in store.files(step):
            if file % local_world != local_rank:
                continue
            reason = store.refusal(step, file, world_size)
            if reason is None:
                held.setdefault(step, []).append(file)
            elif store.header(step, file, world_size) is not None:  # none: torn by the kill, or of another world size
                warn(f"snapshot refused: {reason}")
    return held


def agree(
    store: SnapshotStore | None, module: nn.Module, comms: Collectives, *, disk_step: int | None, warn: Callable[[str], None]
) -> Choice:
    """Steps 1 and 2 above: the same Choice on every rank."""
    view = describe(module)
    local_world = local_world_size()
    rank = dist.get_rank()
    held = verified_files(store, view.shard_factor, local_rank=rank % local_world, local_world=local_world, warn=warn) if store else {}
    # the files every rank's load reads besides its own (the layout's whole tensors): every step's manifest is the same
    shared = load_manifest(store.step_dir(max(held))).layout().whole_tensor_files() if store and held else set()
    gathered = comms.all_gather_object((held, view.shard_rank, shared, rank // local_world), None, label="snapshots held")
    everyone = set().union(*(g[2] for g in gathered))  # the same on every rank that has a manifest
    needed = [sorted({g[1], *everyone}) for g in gathered]
    return choose([g[0] for g in gathered], needed, [g[3] for g in gathered], disk_step=disk_step)


def fetch(store: SnapshotStore, choice: Choice, world_size: int) -> None:
    """Step 3: the transfers of `choice`, in the same order on every rank (a blocking pair
    at a time never waits on a rank that waits on it), then a barrier: a node's other ranks
    read what its receiver wrote."""
    if not choice.transfers or choice.step is None:
        return
    rank = dist.get_rank()
    for transfer in choice.transfers:
        if rank == transfer.sender:
            header, payload = store.read(choice.step, transfer.file, world_size)
            manifest_bytes = (store.step_dir(choice.step) / MANIFEST_NAME).read_bytes()
            for work in send_parts([header.to_bytes(), manifest_bytes, payload], transfer.receiver, None):
                work.wait()
        elif rank == transfer.receiver:
            head, manifest, data = receive_parts(transfer.sender, None)
            store.put(SnapshotHeader.from_bytes(head), data, manifest=manifest)
    dist.barrier()


def restore(
    store: SnapshotStore | None,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    comms: Collectives,
    *,
    disk_step: int | None,
    warn: Callable[[str], None],
) -> tuple[Choice, dict | None]:
    """The steps above, on every rank (`store` None on a node that keeps no snapshots): (the choice,
    the snapshot's training state; None for disk or nothing, which the caller loads as before)."""
    choice = agree(store, module, comms, disk_step=disk_step, warn=warn)
    if store is None or choice.source not in (Source.MEMORY, Source.PEER) or choice.step is None:
        return choice, None
    fetch(store, choice, describe(module).shard_factor)
    step_dir = store.step_dir(choice.step)
    load_manifest(step_dir)  # a plain DataCheckError here, rather than deep in the reader
    return choice, Checkpointer(module, optimizer).load(step_dir, every_replica=True)  # each node's own memory
