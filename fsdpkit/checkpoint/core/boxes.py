"""Chunks of a tensor as boxes (offsets + sizes per dimension): pure arithmetic.

A DCP chunk is a box of the tensor, stored C-contiguous. In the tensor's flat form it is a set
of contiguous runs: the dimensions after the last one the box does not span whole collapse
into one run per index of the dimensions before it. A dim-0 shard (FSDP2) is one run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence


def flat_runs(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first element in the tensor's flat form, elements, first element in the chunk's data)
    of each contiguous run of the box, in increasing order."""
    count = math.prod(sizes)
    if not count:
        return
    dims = len(shape)
    split = dims - 1  # the last dimension the box does not span whole; everything after it collapses
    while split >= 0 and offsets[split] == 0 and sizes[split] == shape[split]:
        split -= 1
    if split < 0:
        yield 0, count, 0
        return
    run = sizes[split] * math.prod(shape[split + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(dims)]
    base = sum(o * s for o, s in zip(offsets, strides, strict=True))
    for position, index in enumerate(itertools.product(*(range(s) for s in sizes[:split]))):
        yield base + sum(i * strides[d] for d, i in enumerate(index)), run, position * run


def run_count(shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]) -> int:
    split = len(shape) - 1
    while split >= 0 and offsets[split] == 0 and sizes[split] == shape[split]:
        split -= 1
    return math.prod(sizes[:split]) if split >= 0 else 1


def _overlap(a: tuple[Sequence[int], Sequence[int]], b: tuple[Sequence[int], Sequence[int]]) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1], strict=True))


def coverage_problem(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """None when the non-empty boxes tile `shape` exactly once, else what is wrong."""
    boxes = [box for box in boxes if math.prod(box[1])]
    if not shape:
        return None if len(boxes) == 1 else f"{len(boxes)} chunks of a scalar"
    active: list[tuple[Sequence[int], Sequence[int]]] = []
    for box in sorted(boxes, key=lambda box: tuple(box[0])):  # sweep along dimension 0: only boxes still open there can overlap
        active = [other for other in active if other[0][0] + other[1][0] > box[0][0]]
        for other in active:
            if _overlap(box, other):
                return f"chunks at {list(other[0])} and {list(box[0])} overlap"
        active.append(box)
    covered = sum(math.prod(box[1]) for box in boxes)
    if covered != math.prod(shape):
        return f"chunks cover {covered} of {math.prod(shape)} elements (a gap)"
    return None
