"""One tensor of per-rank `torch.save` state dicts from its ranks' records: where its elements
lie in the rank files (no torch). Which DTensors and ShardedTensors are read, and how, and which
are refused with one line naming the tensor: docs/deepspeed.md, "Per-rank torch.save state dicts (verl)".
"""

from __future__ import annotations

from typing import Any

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from ..core.names import numel
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile
from .unpickler import DTensorRecord, Replicate, Shard, ShardedTensorRecord

FSDP2, FSDP1, PLAIN = "FSDP2 DTensors", "FSDP1 ShardedTensors", "plain tensors"


def sharding_of(records: Any) -> str:
    """What a model file's values are: FSDP2 DTensors, FSDP1 ShardedTensors or plain tensors."""
    kinds = {type(record) for record in records}
    if ShardedTensorRecord in kinds:
        return FSDP1
    return FSDP2 if DTensorRecord in kinds else PLAIN


def source_tensor(name: str, files: list[SaveFile], records: list[Any]) -> SourceTensor:
    """The whole tensor `name` from each rank's record of it (rank order)."""
    first = records[0]
    if isinstance(first, u.TensorRecord):
        where = files[0].tensor_range(first, name)
        return SourceTensor(name, tuple(first.shape), where.dtype, (where.piece(name, 0, where.numel, 0),))
    if isinstance(first, ShardedTensorRecord):
        return _sharded_tensor(name, files, records)
    if not isinstance(first, DTensorRecord):
        return _refuse(files[0], name, f"a {type(first).__name__}, not a tensor")
    if len(first.placements) != 1:
        return _refuse(files[0], name, f"a DTensor on a {len(first.placements)}-D mesh")
    placement = first.placements[0]
    if isinstance(placement, Replicate):
        where = files[0].tensor_range(first.local, name)
        return SourceTensor(name, first.shape, where.dtype, (where.piece(name, 0, where.numel, 0),))
    if not isinstance(placement, Shard) or placement.get("dim") != 0:
        return _refuse(files[0], name, f"a DTensor placed as {type(placement).__name__} {placement.__dict__}")
    dtype = files[0].tensor_range(first.local, name).dtype
    pieces, start = [], 0
    for rank_file, record in zip(files, records, strict=True):
        if not isinstance(record, DTensorRecord) or record.shape != first.shape:
            return _refuse(rank_file, name, f"not the DTensor of shape {list(first.shape)} rank 0 holds")
        where = rank_file.tensor_range(record.local, name)
        if where.numel:
            pieces.append(where.piece(name, 0, where.numel, start))
        start += where.numel
    if start != numel(first.shape):
        return _refuse(files[0], name, f"the ranks' parts hold {start} elements, its shape {list(first.shape)}")
    return SourceTensor(name, first.shape, dtype, tuple(pieces))


def _sharded_tensor(name: str, files: list[SaveFile], records: list[Any]) -> SourceTensor:
    """Every rank's local shards, each a block of whole rows, covering the tensor exactly once."""
    shape, dtype = records[0].shape, records[0].dtype
    row = numel(shape[1:])
    pieces = []
    for rank_file, record in zip(files, records, strict=True):
        if not isinstance(record, ShardedTensorRecord) or record.shape != shape or record.dtype != dtype:
            return _refuse(rank_file, name, f"not the {dtype} ShardedTensor of shape {list(shape)} rank 0 holds")
        for shard in record.shards:
            what = f"a ShardedTensor {list(shape)} with a shard of sizes {list(shard.sizes)} at offsets {list(shard.offsets)}"
            if not (len(shard.offsets) == len(shape) >= 1 and not any(shard.offsets[1:]) and shard.sizes[1:] == shape[1:]):
                return _refuse(rank_file, name, f"{what}, not a block of whole rows")
            if shard.tensor.shape != shard.sizes:
                return _refuse(rank_file, name, f"{what} held in a {list(shard.tensor.shape)} tensor")
            where = rank_file.tensor_range(shard.tensor, name)
            if where.dtype != dtype:
                return _refuse(rank_file, name, f"a {dtype} ShardedTensor with a {where.dtype} shard")
            if where.numel:
                pieces.append(where.piece(name, 0, where.numel, shard.offsets[0] * row))
    problem = f"{files[0].path.parent}: ShardedTensor {name!r} {list(shape)}: its ranks' shards"
    position = 0
    for piece in sorted(pieces, key=lambda p: p.range.start):
        if piece.range.start != position:
            what = "overlap" if piece.range.start < position else "leave a gap"
            raise DataCheckError(f"{problem} {what} at element {min(position, piece.range.start)} (damaged, or files of two runs?)")
        position = piece.range.end
    if position != numel(shape):
        raise DataCheckError(f"{problem} end at element {position} of {numel(shape)} (damaged, or files of two runs?)")
    return SourceTensor(name, shape, dtype, tuple(pieces))


def _refuse(rank_file: SaveFile, name: str, what: str) -> SourceTensor:
    raise DataCheckError(f"{rank_file.path}: {name!r} is {what}, which fsdpkit does not read")
