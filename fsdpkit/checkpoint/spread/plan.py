"""Which rank writes which bytes of a conversion's output (pure arithmetic, no process group).

The output is a list of files of known size (`OutputFile`). A file that the format lets several
processes write (`cuts`: the byte offsets a part may start at) and that is larger than an eighth
of a fair share is cut into parts of about that size, so that no share is much more than the
fair one; the others are written whole by one rank. Parts go to ranks largest first, each to the
rank with the fewest bytes so far (ties: the lowest rank), which the plan reports as the largest
share against the mean. A file larger than a fair share that cannot be cut is named in `notes`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

from ...sizes import format_size

SPLIT_FRACTION = 8  # a splittable file is cut into parts of about fair share / SPLIT_FRACTION
BALANCED = 1.05  # a plan of whole files this even is kept as it is


@dataclass(frozen=True)
class OutputFile:
    """One output file: its name, its size in bytes and where it may be cut. `cuts` holds
    (first, last, step) runs: offsets first, first + step, ... up to last may start a part;
    empty: the file is written whole (`why_whole` says why, when it is worth saying)."""

    name: str
    nbytes: int
    cuts: tuple[tuple[int, int, int], ...] = ()
    why_whole: str = ""

    def nearest_cut(self, target: int) -> int | None:
        """The allowed offset nearest to `target`, strictly inside the file; None if there is none."""
        best = None
        starts = [first for first, _, _ in self.cuts]
        at = bisect.bisect_right(starts, target)
        for first, last, step in self.cuts[max(0, at - 1) : at + 1]:
            below = first + max(0, min(target, last) - first) // step * step
            for candidate in (below, min(below + step, last)):
                if 0 < candidate < self.nbytes and (best is None or abs(candidate - target) < abs(best - target)):
                    best = candidate
        return best


@dataclass(frozen=True)
class Part:
    """Bytes [begin, end) of output file `file` (an index into the plan's files), its `index`-th part."""

    file: int
    index: int
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Plan:
    world_size: int
    files: tuple[OutputFile, ...]
    parts: tuple[Part, ...]  # in file order
    owners: tuple[int, ...]  # the rank of each part
    notes: tuple[str, ...] = field(default=())

    def parts_of(self, rank: int) -> list[Part]:
        """Rank `rank`'s parts, in file order (each file front to back)."""
        return [part for part, owner in zip(self.parts, self.owners, strict=True) if owner == rank]

    def parts_of_file(self, file: int) -> list[Part]:
        return [part for part in self.parts if part.file == file]

    def rank_bytes(self) -> list[int]:
        shares = [0] * self.world_size
        for part, owner in zip(self.parts, self.owners, strict=True):
            shares[owner] += part.nbytes
        return shares

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    @property
    def imbalance(self) -> float:
        """The largest rank's bytes against the mean (1.0: perfectly even)."""
        total = self.total_bytes
        return max(self.rank_bytes()) * self.world_size / total if total else 1.0

    def label(self, part: Part) -> str:
        """How messages name a part: the file, and its byte range when it is one of several."""
        name = self.files[part.file].name
        if len(self.parts_of_file(part.file)) == 1:
            return name
        return f"{name} bytes [{part.begin}, {part.end})"

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "files": [{"name": f.name, "bytes": f.nbytes, "splittable": bool(f.cuts)} for f in self.files],
            "parts": [[p.file, p.index, p.begin, p.end, owner] for p, owner in zip(self.parts, self.owners, strict=True)],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, document: dict) -> Plan:
        files = tuple(OutputFile(f["name"], f["bytes"]) for f in document["files"])
        parts = tuple(Part(file, index, begin, end) for file, index, begin, end, _ in document["parts"])
        owners = tuple(row[4] for row in document["parts"])
        return cls(document["world_size"], files, parts, owners, tuple(document["notes"]))


def make_plan(files: list[OutputFile], world_size: int) -> Plan:
    """Every file's bytes assigned to one of `world_size` ranks (see the module docstring)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    whole = [Part(index, 0, 0, f.nbytes) for index, f in enumerate(files)]
    plan = _assign(files, whole, world_size)
    total = sum(f.nbytes for f in files)
    fair = total / world_size
    if world_size > 1 and plan.imbalance > BALANCED and any(f.cuts for f in files):
        parts = [part for index, f in enumerate(files) for part in split_file(index, f, math.ceil(fair / SPLIT_FRACTION))]
        split = _assign(files, parts, world_size)
        plan = split if split.imbalance < plan.imbalance else plan
    notes = tuple(
        f"{f.name} ({format_size(f.nbytes)}) is more than a fair share ({format_size(int(fair))}) and cannot be split: {f.why_whole}"
        for f in files
        if world_size > 1 and f.nbytes > fair and not f.cuts and f.why_whole
    )
    return Plan(plan.world_size, plan.files, plan.parts, plan.owners, notes)


def split_file(index: int, file: OutputFile, target: int) -> list[Part]:
    """File `index` cut at its allowed offsets nearest to multiples of nbytes / k, for the
    smallest k whose parts are at most `target` bytes; one part when it cannot be cut."""
    count = max(1, math.ceil(file.nbytes / max(1, target)))
    cuts = {0, file.nbytes}
    for step in range(1, count if file.cuts else 1):
        cut = file.nearest_cut(file.nbytes * step // count)
        if cut is not None:
            cuts.add(cut)
    bounds = sorted(cuts)
    return [Part(index, number, begin, end) for number, (begin, end) in enumerate(zip(bounds, bounds[1:], strict=False))]


def _assign(files: list[OutputFile], parts: list[Part], world_size: int) -> Plan:
    """Largest part first, each to the rank with the fewest bytes so far (ties: the lowest rank)."""
    loads = [(0, rank) for rank in range(world_size)]
    owner: dict[tuple[int, int], int] = {}
    for part in sorted(parts, key=lambda p: (-p.nbytes, p.file, p.index)):
        load, rank = heapq.heappop(loads)
        owner[(part.file, part.index)] = rank
        heapq.heappush(loads, (load + part.nbytes, rank))
    ordered = sorted(parts, key=lambda p: (p.file, p.index))
    return Plan(world_size, tuple(files), tuple(ordered), tuple(owner[(p.file, p.index)] for p in ordered))
