"""Parameters as slices of DeepSpeed's flat fp32 buffers (pure arithmetic, no files read), laid
out as `partition` describes.

A `Flat` is a run of tensors (each a `TensorRange` of a rank file) read as one flat array;
`pieces(name, first, count, dest)` gives the `SourcePiece`s for its elements
[first, first + count), placed at elements [dest, dest + count) of the parameter.
ZeRO 1/2 read one `Flat` per group (its partitions in rank order: a parameter is the slice at
its running offset, and may span ranks); ZeRO 3 one per rank (its partitions of every group:
rank r holds elements [r * p, (r + 1) * p) of a parameter at the same running offset).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..format.bytecopy import SourcePiece
from ..torchfile.savefile import TensorRange
from .partition import NCCL_START_ALIGNMENT_FACTOR


@dataclass(frozen=True)
class Flat:
    parts: tuple[TensorRange, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parts)

    def pieces(self, name: str, first: int, count: int, dest: int) -> list[SourcePiece]:
        if first + count > self.numel:
            raise DataCheckError(f"{name!r}: elements up to {first + count} of a flat buffer of {self.numel} (too short)")
        out, start = [], 0
        for part in self.parts:
            lo, hi = max(first, start), min(first + count, start + part.numel)
            if lo < hi:
                itemsize = dtype_info(part.dtype).itemsize
                at = dest + lo - first
                out.append(
                    SourcePiece(
                        ElementRange(at, at + hi - lo), part.path, part.offset + (lo - start) * itemsize, (hi - lo) * itemsize, None, name
                    )
                )
            start += part.numel
        return out


def flats_of(stage: int, per_rank: Sequence[Sequence[TensorRange]]) -> list[Flat]:
    """`per_rank[r][g]`: rank r's partition of group g."""
    if stage <= 2:
        return [Flat(tuple(rank[g] for rank in per_rank)) for g in range(len(per_rank[0]))]
    return [Flat(tuple(rank)) for rank in per_rank]


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


def slot_pieces(stage: int, slot: ZeroSlot, flats: Sequence[Flat]) -> list[SourcePiece]:
    total = math.prod(slot.shape)
    if stage <= 2:
        return flats[slot.group].pieces(slot.name, slot.offset, total, 0)
    per_rank = math.ceil(total / len(flats))
    out = []
    for rank, flat in enumerate(flats):
        first = rank * per_rank
        count = min(per_rank, total - first)
        if count > 0:
            out.extend(flat.pieces(slot.name, slot.offset, count, first))
    return out
