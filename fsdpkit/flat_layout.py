"""Pure arithmetic of the flat-parameter layout: no process group, no tensors.

A unit's parameters are flattened and concatenated in order, right-padded to a multiple of
the sharding factor F, and cut into F equal chunks; rank r keeps chunk r. Every saved tensor
is seen as its flat form of `numel` elements, and a piece of it held somewhere is a
*fragment*: the element range [start, end) of that flat form. Checkpoints, resharding and
the engine all use the functions here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class ElementRange:
    """Half-open range [start, end) of elements."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"invalid element range [{self.start}, {self.end})")

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: ElementRange) -> ElementRange:
        start = max(self.start, other.start)
        end = min(self.end, other.end)
        return ElementRange(start, max(start, end))

    def shift(self, offset: int) -> ElementRange:
        return ElementRange(self.start + offset, self.end + offset)


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter inside a flat parameter."""

    name: str
    shape: tuple[int, ...]
    offset: int  # where its first element sits in the (unpadded) flat parameter

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def flat_range(self) -> ElementRange:
        return ElementRange(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class Fragment:
    """The part of one parameter that a rank's chunk holds.

    `param_range` is the range in the parameter's own flat form; `local_offset` is where it
    starts inside the rank's chunk.
    """

    name: str
    param_range: ElementRange
    local_offset: int


@dataclass(frozen=True)
class FlatLayout:
    """The layout of one unit's flat parameter for a sharding factor."""

    slots: tuple[ParamSlot, ...]
    shard_factor: int

    def __post_init__(self) -> None:
        if self.shard_factor < 1:
            raise UsageError(f"sharding factor must be >= 1, got {self.shard_factor}")
        names = [slot.name for slot in self.slots]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate parameter names in one flat parameter: {names}")

    @classmethod
    def from_shapes(cls, named_shapes: list[tuple[str, tuple[int, ...]]], shard_factor: int) -> FlatLayout:
        slots, offset = [], 0
        for name, shape in named_shapes:
            slot = ParamSlot(name, tuple(int(d) for d in shape), offset)
            slots.append(slot)
            offset += slot.numel
        return cls(tuple(slots), shard_factor)

    @property
    def numel(self) -> int:
        """Elements of real parameters (no padding)."""
        return sum(slot.numel for slot in self.slots)

    @property
    def padded_numel(self) -> int:
        return padded_size(self.numel, self.shard_factor)

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @property
    def chunk_numel(self) -> int:
        return self.padded_numel // self.shard_factor

    def chunk_range(self, rank: int) -> ElementRange:
        """The range of the padded flat parameter that `rank` keeps."""
        if not 0 <= rank < self.shard_factor:
            raise ValueError(f"rank {rank} outside sharding factor {self.shard_factor}")
        return ElementRange(rank * self.chunk_numel, (rank + 1) * self.chunk_numel)

    def split_sizes(self) -> list[int]:
        """Sizes that split the padded flat parameter into its parameters, then the padding."""
        return [slot.numel for slot in self.slots] + [self.padding]

    def fragments(self, rank: int) -> list[Fragment]:
        """Every parameter's piece of `rank`'s chunk, in flat order, empty pieces included."""
        chunk = self.chunk_range(rank)
        result = []
        for slot in self.slots:
            overlap = slot.flat_range.intersect(chunk)
            if overlap.size == 0:
                start = min(max(chunk.start, slot.offset), slot.offset + slot.numel)
                param_range = ElementRange(start - slot.offset, start - slot.offset)
                local_offset = min(max(slot.offset - chunk.start, 0), chunk.size)
            else:
                param_range = overlap.shift(-slot.offset)
                local_offset = overlap.start - chunk.start
            result.append(Fragment(slot.name, param_range, local_offset))
        return result


def padded_size(numel: int, shard_factor: int) -> int:
    """The smallest multiple of `shard_factor` that is >= numel."""
    return -(-numel // shard_factor) * shard_factor


def even_split_ranges(numel: int, world_size: int) -> list[ElementRange]:
    """An even per-tensor split for tensors with no flat-parameter plan (torch.chunk style:
    ceil(numel / world_size) per rank, trailing ranks possibly short or empty)."""
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    per_rank = -(-numel // world_size) if numel else 0
    return [ElementRange(min(r * per_rank, numel), min((r + 1) * per_rank, numel)) for r in range(world_size)]
