"""How DeepSpeed ZeRO lays parameter groups out across N data-parallel ranks (pure arithmetic):
`partitions` as the writer cuts them into `Segment`s, `Flat`s and slots as the reader finds
parameters in them (a `Flat`: a run of a rank file's tensors read as one flat array).

Stages 1 and 2 flatten the group's parameters in order into one buffer, pad its end to a
multiple of `2 * N` elements (`nccl_start_alignment_factor` times the world size) and cut it
into N equal partitions; the padding lies at the end of the last ranks. A rank's
`param_slice_mappings` name each parameter its partition touches with the part it holds. Read
back, a parameter is the slice at its running offset of the group's partitions in rank order
(one `Flat` per group; it may span ranks).

Stage 3 partitions every parameter on its own: `ceil(numel / N)` elements per rank, the last
ranks padded with zeros, and a rank's flat group is its part of each parameter in order. Read
back (one `Flat` per rank, its partitions of every group), rank r holds elements
[r * p, (r + 1) * p) of a parameter at the same running offset.

A parameter read back is a `ZeroSource`: its slot and the flats, its pieces worked out for the
elements a reader asks for and never listed (listed, a ZeRO-3 checkpoint of N ranks holds N
pieces a parameter: 405B parameters and their Adam moments saved by 1024 ranks are 3.5 M).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourcePiece, SourceTensor
from ..torchfile.savefile import TensorRange

NCCL_START_ALIGNMENT_FACTOR = 2
STAGES = (1, 2, 3)


@dataclass(frozen=True)
class Segment:
    """`elements` of parameter `name` (or, when `name` is None, `elements.size` zeros)."""

    name: str | None
    elements: ElementRange


@dataclass(frozen=True)
class RankPartition:
    segments: tuple[Segment, ...]
    padding: int  # zeros at the end of this rank's partition (stages 1 and 2: `group_paddings`)

    @property
    def numel(self) -> int:
        return sum(s.elements.size for s in self.segments)

    def slice_mappings(self) -> list[tuple[str, int, int]]:
        """(name, start within the partition, numel) of each parameter part, as DeepSpeed's
        `fragment_address`es."""
        out, position = [], 0
        for segment in self.segments:
            if segment.name is not None:
                out.append((segment.name, position, segment.elements.size))
            position += segment.elements.size
        return out


def flat_partitions(params: list[tuple[str, int]], world_size: int) -> list[RankPartition]:
    """Stages 1 and 2: the group's flat buffer (params as (name, numel), in order) cut for N ranks."""
    total = sum(numel for _, numel in params)
    alignment = NCCL_START_ALIGNMENT_FACTOR * world_size
    padded = -(-total // alignment) * alignment
    size = padded // world_size
    partitions = []
    for rank in range(world_size):
        start, end = rank * size, (rank + 1) * size
        segments, offset = [], 0
        for name, numel in params:
            low, high = max(start, offset), min(end, offset + numel)
            if low < high:
                segments.append(Segment(name, ElementRange(low - offset, high - offset)))
            offset += numel
        padding = min(size, end - max(start, total)) if end > total else 0
        if padding:
            segments.append(Segment(None, ElementRange(0, padding)))
        partitions.append(RankPartition(tuple(segments), padding))
    return partitions


def param_partitions(params: list[tuple[str, int]], world_size: int) -> list[RankPartition]:
    """Stage 3: every parameter cut into N equal parts of ceil(numel / N), zero-padded."""
    partitions = []
    for rank in range(world_size):
        segments = []
        for name, numel in params:
            size = -(-numel // world_size)
            low, high = min(rank * size, numel), min((rank + 1) * size, numel)
            if low < high:
                segments.append(Segment(name, ElementRange(low, high)))
            if size - (high - low):
                segments.append(Segment(None, ElementRange(0, size - (high - low))))
        partitions.append(RankPartition(tuple(segments), 0))
    return partitions


def partitions(stage: int, params: list[tuple[str, int]], world_size: int) -> list[RankPartition]:
    if stage not in STAGES:
        raise UsageError(f"--stage must be one of {', '.join(map(str, STAGES))}, got {stage}")
    return (param_partitions if stage == 3 else flat_partitions)(params, world_size)


@dataclass(frozen=True)
class Flat:
    parts: tuple[TensorRange, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)

    def pieces(self, name: str, first: int, count: int, dest: int) -> list[SourcePiece]:
        """Elements [first, first + count) of the array, placed at [dest, dest + count) of parameter `name`."""
        if first + count > self.numel:
            raise DataCheckError(f"{name!r}: elements up to {first + count} of a flat buffer of {self.numel} (too short)")
        out, start = [], 0
        for part in self.parts:
            lo, hi = max(first, start), min(first + count, start + part.numel)
            if lo < hi:
                out.append(part.piece(name, lo - start, hi - lo, dest + lo - first))
            start += part.numel
        return out


def flats_of(stage: int, per_rank: Sequence[Sequence[TensorRange]]) -> tuple[Flat, ...]:
    """`per_rank[r][g]`: rank r's partition of group g."""
    if stage <= 2:
        return tuple(Flat(tuple(rank[g] for rank in per_rank)) for g in range(len(per_rank[0])))
    return tuple(Flat(tuple(rank)) for rank in per_rank)


@dataclass(frozen=True)
class ZeroSlot:
    """One parameter inside DeepSpeed's flat arrays (fsdpkit's own flat parameters hold `flat_layout.ParamSlot`s)."""

    name: str
    shape: tuple[int, ...]
    group: int  # ZeRO 1/2: the parameter group; ZeRO 3: 0 (one flat array per rank)
    offset: int  # running offset in its flat array (ZeRO 3: in each rank's)


def zero12_slots(param_shapes: Sequence[dict[str, tuple[int, ...]]], group_sizes: Sequence[int], ranks: int) -> list[ZeroSlot]:
    """Slots of ZeRO 1/2: running offsets per group; the group's padded size must be what the
    partitions hold (zero_to_fp32's check)."""
    slots = []
    for group, (shapes, available) in enumerate(zip(param_shapes, group_sizes, strict=True)):
        offset = 0
        for name, shape in shapes.items():
            slots.append(ZeroSlot(name, shape, group, offset))
            offset += math.prod(shape)
        align = NCCL_START_ALIGNMENT_FACTOR * ranks
        if align * math.ceil(offset / align) != align * math.ceil(available / align):
            raise DataCheckError(f"parameter group {group}: the parameters take {offset} elements, the partitions hold {available}")
    return slots


def zero3_slots(param_shapes: Sequence[dict[str, tuple[int, ...]]], rank_numel: int, ranks: int) -> list[ZeroSlot]:
    slots, offset = [], 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            slots.append(ZeroSlot(name, shape, 0, offset))
            offset += math.ceil(math.prod(shape) / ranks)
    if offset != rank_numel:
        raise DataCheckError(f"the parameters take {offset} elements per rank, each rank's partitions hold {rank_numel}")
    return slots


def slot_pieces(stage: int, slot: ZeroSlot, flats: Sequence[Flat], wanted: ElementRange | None = None) -> list[SourcePiece]:
    """The pieces of `slot`'s parameter, in order; with `wanted`, only those that meet it."""
    total = math.prod(slot.shape)
    if stage <= 2:
        found = flats[slot.group].pieces(slot.name, slot.offset, total, 0)
        return found if wanted is None else [p for p in found if p.range.start < wanted.end and wanted.start < p.range.end]
    per_rank = math.ceil(total / len(flats))
    ranks = range(len(flats)) if wanted is None or not per_rank else range(wanted.start // per_rank, -(-wanted.end // per_rank))
    out = []
    for rank in ranks:
        first = rank * per_rank
        count = min(per_rank, total - first)
        if count > 0 and rank < len(flats):
            out.extend(flats[rank].pieces(slot.name, slot.offset, count, first))
    return out if wanted is None else [p for p in out if p.range.start < wanted.end and wanted.start < p.range.end]


def check_fits(stage: int, slots: Sequence[ZeroSlot], flats: Sequence[Flat]) -> None:
    """What reading every slot's pieces would find first (DataCheckError): a flat array too short."""
    sizes = [flat.numel for flat in flats]
    lowest = list(itertools.accumulate(sizes, min))  # lowest[r]: the shortest of flats 0..r
    for slot in slots:
        total = math.prod(slot.shape)
        if stage <= 2:
            needs = [(slot.offset + total, sizes[slot.group])]
        else:  # ranks 0..full-1 hold per_rank elements each, rank `full` the rest
            per_rank = math.ceil(total / len(flats))
            full, rest = divmod(total, per_rank) if per_rank else (0, 0)
            needs = ([(slot.offset + per_rank, lowest[full - 1])] if full else []) + ([(slot.offset + rest, sizes[full])] if rest else [])
        for need, size in needs:
            if need > size:
                raise DataCheckError(f"{slot.name!r}: elements up to {need} of a flat buffer of {size} (too short)")


@dataclass(frozen=True)
class ZeroSource(SourceTensor):
    """A tensor laid out as a parameter in DeepSpeed's flat arrays (see the module docstring)."""

    stage: int = 3
    slot: ZeroSlot = ZeroSlot("", (), 0, 0)
    flats: tuple[Flat, ...] = field(default=(), compare=False, repr=False)

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        return slot_pieces(self.stage, self.slot, self.flats, wanted)
