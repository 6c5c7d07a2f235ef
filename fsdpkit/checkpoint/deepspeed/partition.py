"""How DeepSpeed ZeRO lays one parameter group out across N data-parallel ranks (pure arithmetic).

Stages 1 and 2 flatten the group's parameters in order into one buffer, pad its end to a
multiple of `2 * N` elements (`nccl_start_alignment_factor` times the world size) and cut it
into N equal partitions; the padding lies at the end of the last ranks. A rank's
`param_slice_mappings` name each parameter its partition touches with the part it holds.

Stage 3 partitions every parameter on its own: `ceil(numel / N)` elements per rank, the last
ranks padded with zeros, and a rank's flat group is its part of each parameter in order.

A rank's flat buffer is a list of `Segment`s: a range of a parameter's flat elements, or padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from ...flat_layout import ElementRange

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


def _padding(count: int) -> Segment:
    return Segment(None, ElementRange(0, count))


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
            segments.append(_padding(padding))
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
                segments.append(_padding(size - (high - low)))
        partitions.append(RankPartition(tuple(segments), 0))
    return partitions


def partitions(stage: int, params: list[tuple[str, int]], world_size: int) -> list[RankPartition]:
    if stage not in STAGES:
        raise UsageError(f"--stage must be one of {', '.join(map(str, STAGES))}, got {stage}")
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    return (param_partitions if stage == 3 else flat_partitions)(params, world_size)
