"""Per-rank `torch.save` state dicts as a table of tensors whose elements lie at byte ranges of
the rank files (no torch): `model_world_size_W_rank_R.pt` for R in 0..W-1, as verl's FSDP
checkpoint manager writes them beside `optim_...` and `extra_state_...` files.

A DTensor sharded on dim 0 over a 1-D mesh (FSDP2) is its ranks' local tensors in rank order;
a replicated one, or a plain tensor, is rank 0's. Other placements are refused with one line.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..dcp import unpickler as u
from ..deepspeed.rankfile import RankFile
from ..format.bytecopy import SourcePiece, SourceTensor
from ..format.names import numel
from .unpickler import DTensorRecord, Replicate, Shard, loads

FORMAT = "torch-save-ranks"
_MODEL_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def _model_files(directory: Path) -> dict[int, tuple[int, Path]]:
    found = {}
    for path in directory.iterdir():
        match = _MODEL_FILE.fullmatch(path.name)
        if match:
            found[int(match.group(2))] = (int(match.group(1)), path)
    return found


def is_torchsave_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A directory holding `model_world_size_W_rank_0.pt`."""
    path = Path(path)
    return path.is_dir() and 0 in _model_files(path)


@dataclass
class RankStateDicts:
    directory: Path
    world_size: int
    model: list[SourceTensor] = field(default_factory=list)
    other_files: list[str] = field(default_factory=list)  # optim_..., extra_state_... (not read)
    opened: list[RankFile] = field(default_factory=list)

    def close(self) -> None:
        for rank_file in self.opened:
            rank_file.close()

    def __enter__(self) -> RankStateDicts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_rank_state_dicts(path: str | os.PathLike[str]) -> RankStateDicts:
    """Every rank's model file read through the allow-list; each tensor's place checked."""
    directory = Path(path)
    files = _model_files(directory)
    if 0 not in files:
        raise DataCheckError(f"{directory}: no model_world_size_W_rank_0.pt")
    world_size = files[0][0]
    sizes = sorted({size for size, _ in files.values()})
    if sizes != [world_size] or sorted(files) != list(range(world_size)):
        raise DataCheckError(
            f"{directory}: model files of ranks {sorted(files)} and world sizes {sizes}, expected ranks 0..{world_size - 1}"
        )
    others = sorted(p.name for p in directory.iterdir() if p.name.endswith(".pt") and not _MODEL_FILE.fullmatch(p.name))
    checkpoint = RankStateDicts(directory, world_size, other_files=others)
    try:
        for rank in range(world_size):
            checkpoint.opened.append(RankFile(files[rank][1], loads))
        checkpoint.model = _tensors(checkpoint.opened)
    except BaseException:
        checkpoint.close()
        raise
    return checkpoint


def _state(rank_file: RankFile) -> dict[str, Any]:
    state = rank_file.state
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise DataCheckError(f"{rank_file.path}: not a state dict of named tensors")
    return state


def _tensors(files: list[RankFile]) -> list[SourceTensor]:
    states = [_state(f) for f in files]
    names = list(states[0])
    for rank_file, state in zip(files, states, strict=True):
        if list(state) != names:
            raise DataCheckError(f"{rank_file.path}: other tensor names than {files[0].path.name} (files of two runs?)")
    return [_tensor(name, files, [s[name] for s in states]) for name in names]


def _tensor(name: str, files: list[RankFile], records: list[Any]) -> SourceTensor:
    first = records[0]
    if isinstance(first, u.TensorRecord):
        where = files[0].tensor_range(first, name)
        return SourceTensor(name, tuple(first.shape), where.dtype, (_piece(name, where, 0),))
    if not isinstance(first, DTensorRecord):
        return _refuse(files[0], name, f"a {type(first).__name__}, not a tensor")
    if len(first.placements) != 1:
        return _refuse(files[0], name, f"a DTensor on a {len(first.placements)}-D mesh")
    placement = first.placements[0]
    if isinstance(placement, Replicate):
        where = files[0].tensor_range(first.local, name)
        return SourceTensor(name, first.shape, where.dtype, (_piece(name, where, 0),))
    if not isinstance(placement, Shard) or placement.get("dim") != 0:
        return _refuse(files[0], name, f"a DTensor placed as {type(placement).__name__} {placement.__dict__}")
    dtype = files[0].tensor_range(first.local, name).dtype
    pieces, start = [], 0
    for rank_file, record in zip(files, records, strict=True):
        if not isinstance(record, DTensorRecord) or record.shape != first.shape:
            return _refuse(rank_file, name, f"not the DTensor of shape {list(first.shape)} rank 0 holds")
        where = rank_file.tensor_range(record.local, name)
        if where.numel:
            pieces.append(_piece(name, where, start))
        start += where.numel
    if start != numel(first.shape):
        return _refuse(files[0], name, f"the ranks' parts hold {start} elements, its shape {list(first.shape)}")
    return SourceTensor(name, first.shape, dtype, tuple(pieces))


def _piece(name: str, where: Any, start: int) -> SourcePiece:
    return SourcePiece(
        ElementRange(start, start + where.numel), where.path, where.offset, where.numel * dtype_info(where.dtype).itemsize, None, name
    )


def _refuse(rank_file: RankFile, name: str, what: str) -> SourceTensor:
    raise DataCheckError(f"{rank_file.path}: {name!r} is {what}, which fsdpkit does not read")
