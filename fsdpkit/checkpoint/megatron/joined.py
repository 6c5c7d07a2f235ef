"""A tensor whose elements are element ranges of other tensors laid end to end (pure range
arithmetic, nothing read): one layer of a stacked `[L, ...]` tensor, the query rows of every
group of a fused QKV weight, the gate half of fc1. The byte engine reads it as any source."""

from __future__ import annotations

import itertools

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.names import numel

Part = tuple[SourceTensor, ElementRange]


class JoinedSource(SourceTensor):
    """`parts` in order make the tensor's flat elements; their pieces are clipped and shifted."""

    parts: tuple[Part, ...]  # set through object.__setattr__: SourceTensor is frozen
    starts: tuple[int, ...]

    def __init__(self, name: str, shape: tuple[int, ...], parts: list[Part]):
        dtypes = {source.dtype for source, _ in parts}
        if len(dtypes) != 1 or sum(r.size for _, r in parts) != numel(shape):
            raise ValueError(f"{name}: parts of {sorted(dtypes)} holding {sum(r.size for _, r in parts)} elements for {list(shape)}")
        super().__init__(name, shape, dtypes.pop())
        object.__setattr__(self, "parts", tuple(parts))
        object.__setattr__(self, "starts", tuple(itertools.accumulate((r.size for _, r in parts), initial=0)))

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        return clipped_pieces(self.parts, self.starts, wanted, dtype_info(self.dtype).itemsize)


def clipped_pieces(
    parts: tuple[Part, ...] | list[Part], starts: tuple[int, ...] | list[int], wanted: ElementRange, itemsize: int
) -> list[SourcePiece]:
    """The pieces of `wanted` where part i (a source and its range) holds elements from `starts[i]` on."""
    found = []
    for (source, taken), start in zip(parts, starts, strict=False):
        low, high = max(wanted.start, start), min(wanted.end, start + taken.size)
        if low >= high:
            continue
        shift = taken.start - start  # element e here is element e + shift of the source
        for piece in source.pieces_in(ElementRange(low + shift, high + shift)):
            first, last = max(piece.range.start, low + shift), min(piece.range.end, high + shift)
            whole = (first, last) == (piece.range.start, piece.range.end)
            offset = piece.offset + (first - piece.range.start) * itemsize
            found.append(
                SourcePiece(
                    ElementRange(first - shift, last - shift),
                    piece.path,
                    offset,
                    (last - first) * itemsize,
                    piece.crc32 if whole else None,
                    piece.key,
                )
            )
    return found


def rows(source: SourceTensor, first: int, count: int) -> ElementRange:
    """Rows [first, first + count) of `source` along dimension 0, as elements."""
    per_row = numel(source.shape[1:])
    return ElementRange(first * per_row, (first + count) * per_row)


def layer_of(stacked: SourceTensor, layer: int, name: str) -> JoinedSource:
    """Layer `layer` of a stacked `[L, ...]` tensor."""
    return JoinedSource(name, tuple(stacked.shape[1:]), [(stacked, rows(stacked, layer, 1))])


def row_blocks(source: SourceTensor, name: str, blocks: list[tuple[int, int]]) -> JoinedSource:
    """Row blocks (first, count) of a 2-D or 1-D tensor, stacked in order."""
    parts = [(source, rows(source, first, count)) for first, count in blocks]
    return JoinedSource(name, (sum(count for _, count in blocks), *source.shape[1:]), parts)
