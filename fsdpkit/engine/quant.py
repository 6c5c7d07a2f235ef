"""Block-wise symmetric int8 quantization for the weight all-gather: pure functions on
tensors, no process group.

A 1-D tensor is cut into blocks of `block` elements from its first element (the last block
may be shorter); each block has one fp32 scale, its largest magnitude / 127, and its
elements are stored as round(x / scale) in int8. Dequantizing multiplies back, so every
element comes back within half a step (scale / 2) of its value.

In the engine the tensor is one rank's chunk of a unit's flat parameter in the compute
dtype: the blocks restart at every chunk boundary, so the rounding depends on the chunk
size (the unit's padded size / the shard factor) as well as on `block`. Where the chunk
size is a multiple of `block` the blocks are those of the whole flat parameter cut from
its start, and the quantized weights are the same at every such shard factor.

On the wire one rank's chunk is one byte row: the scales first (4 bytes each, so the row
can be viewed as fp32 where they sit), then the int8 values, padded to a multiple of 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 127
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
DEFAULT_BLOCK = 256
SLICE_ELEMENTS = 1 << 16  # quantized a slice of blocks at a time


def block_count(numel: int, block: int) -> int:
    return -(-numel // block)


def row_bytes(numel: int, block: int) -> int:
    """Bytes one rank sends for a chunk of `numel` elements: scales, then values padded to 4."""
    return block_count(numel, block) * SCALE_BYTES + -(-numel // SCALE_BYTES) * SCALE_BYTES


def all_gather_bytes(chunk_numel: int, shard_factor: int, *, element_bytes: int, block: int | None) -> int:
    """Bytes an all-gather of a unit moves (its output buffer): `shard_factor` chunks of
    `chunk_numel` elements in the compute dtype, or their int8 rows when `block` is given.
    The engine's buffers have exactly this size, so `comm_stats` and `fsdpkit plan` agree."""
    if block is None:
        return shard_factor * chunk_numel * element_bytes
    return shard_factor * row_bytes(chunk_numel, block)


def _blocks(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole blocks as rows, the short last block: possibly empty), views of `flat`."""
    whole = flat.numel() // block * block
    return flat[:whole].view(-1, block), flat[whole:]


def quantize_into(flat: torch.Tensor, block: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Quantize 1-D `flat` into int8 `values` (same numel) and fp32 `scales` (one per block)."""
    rows, tail = _blocks(flat, block)
    value_rows, value_tail = _blocks(values, block)
    step = max(1, SLICE_ELEMENTS // block)
    whole = rows.shape[0]
    for first in range(0, whole, step):
        last = min(first + step, whole)
        _quantize_rows(rows[first:last], value_rows[first:last], scales[first:last])
    if tail.numel():
        _quantize_rows(tail.view(1, -1), value_tail.view(1, -1), scales[rows.shape[0] :])


def _quantize_rows(source: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> None:
    """One slice of blocks (rows): temporaries stay small, so no fresh pages are touched."""
    source = source.to(SCALE_DTYPE)
    torch.maximum(source.amax(dim=1), source.amin(dim=1).neg_(), out=scale)  # the largest magnitude
    scale.div_(QMAX).clamp_min_(torch.finfo(SCALE_DTYPE).tiny)  # an all-zero block: any scale, zeros come back
    # |x| / scale <= 127 up to rounding, which round() absorbs: no clamp needed.
    target.copy_(torch.div(source, scale[:, None]).round_())


def quantize(flat: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values, fp32 scales) of 1-D `flat` in blocks of `block` elements."""
    values = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
    scales = torch.empty(block_count(flat.numel(), block), dtype=SCALE_DTYPE, device=flat.device)
    quantize_into(flat, block, values, scales)
    return values, scales


def dequantize_into(values: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """values * scale of their block, computed in fp32 and rounded once into `out` (its dtype)."""
    value_rows, value_tail = _blocks(values, block)
    out_rows, out_tail = _blocks(out, block)
    whole = value_rows.shape[0]
    step = max(1, SLICE_ELEMENTS // block)
    for first in range(0, whole, step):
        last = min(first + step, whole)
        _dequantize_rows(value_rows[first:last], scales[first:last], out_rows[first:last])
    if value_tail.numel():
        _dequantize_rows(value_tail.view(1, -1), scales[whole:], out_tail.view(1, -1))


def _dequantize_rows(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    if out.dtype == SCALE_DTYPE:
        out.copy_(values).mul_(scales[:, None])
    else:  # mixed-dtype arithmetic into a 16-bit tensor is slow: multiply in fp32, cast once
        out.copy_(values.to(SCALE_DTYPE).mul_(scales[:, None]))


def dequantize(values: torch.Tensor, scales: torch.Tensor, block: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    out = torch.empty(values.numel(), dtype=dtype, device=values.device)
    dequantize_into(values, scales, block, out)
    return out


def round_trip_sharded(flat: torch.Tensor, shard_factor: int, block: int) -> torch.Tensor:
    """What the int8 all-gather makes of a padded flat parameter (numel divisible by
    `shard_factor`): each of its chunks quantized and dequantized on its own, in its dtype.
    The unsharded form of what every rank computes with, for references and the planner."""
    out = torch.empty_like(flat)
    for chunk, target in zip(flat.view(shard_factor, -1), out.view(shard_factor, -1), strict=True):
        values, scales = quantize(chunk, block)
        dequantize_into(values, scales, block, target)
    return out


@dataclass(frozen=True)
class Int8BlockCodec:
    """The all-gather's codec: one rank's chunk <-> its byte row (scales, then values)."""

    chunk_numel: int
    block: int = DEFAULT_BLOCK

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.chunk_numel, self.block)

    @property
    def _scale_bytes(self) -> int:
        return block_count(self.chunk_numel, self.block) * SCALE_BYTES

    def encode(self, chunk: torch.Tensor) -> torch.Tensor:
        """This rank's chunk as one uint8 row of `row_bytes`."""
        row = torch.zeros(self.row_bytes, dtype=torch.uint8, device=chunk.device)
        scales = row[: self._scale_bytes].view(SCALE_DTYPE)
        values = row[self._scale_bytes : self._scale_bytes + self.chunk_numel].view(torch.int8)
        quantize_into(chunk, self.block, values, scales)
        return row

    def decode(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's row (`rows`: shard factor x row_bytes bytes) into the full flat `out`."""
        for row, target in zip(rows.view(-1, self.row_bytes), out.view(-1, self.chunk_numel), strict=True):
            scales = row[: self._scale_bytes].view(SCALE_DTYPE)
            values = row[self._scale_bytes : self._scale_bytes + self.chunk_numel].view(torch.int8)
            dequantize_into(values, scales, self.block, target)
