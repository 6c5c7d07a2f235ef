"""Which snapshot a restarted group restores (pure arithmetic, no I/O): the newest step whose
needed files every rank finds on its own node (`memory`), or, for some rank, only on another
node, whose holder then sends them (`peer`); unless the newest disk checkpoint is as new (`disk`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Source(Enum):
    MEMORY = "memory"
    PEER = "peer"
    DISK = "disk"
    NONE = "none"  # nothing to restore: the run starts over from its first step


@dataclass(frozen=True)
class Transfer:
    """Rank file `file` goes from global rank `sender` to global rank `receiver`."""

    file: int
    sender: int
    receiver: int


@dataclass(frozen=True)
class Choice:
    source: Source
    step: int | None
    transfers: tuple[Transfer, ...] = ()


def choose(held: list[dict[int, list[int]]], needed: list[list[int]], node_of: list[int], *, disk_step: int | None) -> Choice:
    """`held[r]`: {step: files rank r verified in its node's store}; `needed[r]`: the files rank
    r loads; `node_of[r]`: its node; `disk_step`: the newest disk checkpoint's step (None: none)."""
    for step in sorted({step for by_step in held for step in by_step}, reverse=True):
        if disk_step is not None and step <= disk_step:
            break
        transfers = _transfers(step, held, needed, node_of)
        if transfers is not None:
            return Choice(Source.PEER if transfers else Source.MEMORY, step, transfers)
    return Choice(Source.DISK, disk_step) if disk_step is not None else Choice(Source.NONE, None)


def _transfers(step: int, held: list[dict[int, list[int]]], needed: list[list[int]], node_of: list[int]) -> tuple[Transfer, ...] | None:
    """What must move for every rank to have its needed files of `step` on its node (one copy
    per node: to the node's lowest rank that needs it); None when some file is held nowhere."""
    holders: dict[int, list[int]] = {}
    for rank, by_step in enumerate(held):
        for file in by_step.get(step, []):
            holders.setdefault(file, []).append(rank)
    transfers: dict[tuple[int, int], Transfer] = {}
    for rank, files in enumerate(needed):
        for file in files:
            ranks = holders.get(file, [])
            if not ranks:
                return None
            if not any(node_of[h] == node_of[rank] for h in ranks):
                transfers.setdefault((file, node_of[rank]), Transfer(file, ranks[0], rank))
    return tuple(transfers.values())
