"""Per-rank `torch.save` state dicts (`model_world_size_W_rank_R.pt` for R in 0..W-1, beside
`optim_...` and `extra_state_...` files, as verl's FSDP checkpoint manager writes them) as a
table of tensors at byte ranges of the rank files. The extra state files (the LR scheduler's
state, each rank's RNG states) are read through the allow-list with numpy's arrays admitted;
rank 0's items are the checkpoint's non-tensor items, as plain values.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from ..core.files import source_path
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, open_each
from .optim import OptimizerState, open_optimizer
from .tensors import sharding_of, source_tensor
from .unpickler import extra_state_loads, loads

FORMAT = "torch-save-ranks"
_MODEL_FILE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def _model_files(directory: Path) -> dict[int, tuple[int, Path]]:
    """rank -> (world size, path) of each model file."""
    return {int(match.group(2)): (int(match.group(1)), path) for path in directory.iterdir() if (match := _MODEL_FILE.fullmatch(path.name))}


def is_torchsave_checkpoint(path: str | os.PathLike[str]) -> bool:
    """A directory holding `model_world_size_W_rank_0.pt`."""
    path = source_path(path)
    return path.is_dir() and 0 in _model_files(path)


@dataclass
class RankStateDicts:
    directory: Path
    world_size: int
    model: list[SourceTensor] = field(default_factory=list)
    sharding: str = ""  # what the model files hold: FSDP2 DTensors, FSDP1 ShardedTensors or plain tensors
    optim: OptimizerState = field(default_factory=OptimizerState)
    extra_state: dict[str, Any] = field(default_factory=dict)  # rank 0's extra state, as plain values
    other_files: list[str] = field(default_factory=list)  # the .pt files not read (unread optim_..., others)
    opened: list[SaveFile] = field(default_factory=list)  # the model files, the optimizer files read, the extra state files

    def close(self) -> None:
        for rank_file in self.opened:
            rank_file.close()

    def __enter__(self) -> RankStateDicts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_rank_state_dicts(path: str | os.PathLike[str]) -> RankStateDicts:
    """Every rank's model file (and optimizer file, where it maps to names) read through the
    allow-list; each tensor's place checked."""
    directory = source_path(path)
    files = _model_files(directory)
    if 0 not in files:
        raise DataCheckError(f"{directory}: no model_world_size_W_rank_0.pt")
    world_size = files[0][0]
    sizes = sorted({size for size, _ in files.values()})
    if sizes != [world_size] or sorted(files) != list(range(world_size)):
        raise DataCheckError(
            f"{directory}: model files of ranks {sorted(files)} and world sizes {sizes}, expected ranks 0..{world_size - 1}"
        )
    checkpoint = RankStateDicts(directory, world_size)
    try:
        open_each([files[rank][1] for rank in range(world_size)], lambda _, path: SaveFile(path, loads), checkpoint.opened)
        states = [_state(f) for f in checkpoint.opened]
        checkpoint.model = _tensors(checkpoint.opened, states)
        checkpoint.sharding = sharding_of(states[0].values())
        checkpoint.optim = open_optimizer(directory, world_size, states[0], checkpoint.model)
        checkpoint.opened.extend(checkpoint.optim.opened)
        checkpoint.extra_state = _extra_state(directory, world_size, checkpoint.opened)
    except BaseException:
        checkpoint.close()
        raise
    read = {rf.path.name for rf in checkpoint.opened}
    checkpoint.other_files = sorted(p.name for p in directory.iterdir() if p.name.endswith(".pt") and p.name not in read)
    return checkpoint


def _state(rank_file: SaveFile) -> dict[str, Any]:
    state = rank_file.state
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise DataCheckError(f"{rank_file.path}: not a state dict of named tensors")
    return state


def _tensors(files: list[SaveFile], states: list[dict[str, Any]]) -> list[SourceTensor]:
    names = list(states[0])
    for rank_file, state in zip(files, states, strict=True):
        if list(state) != names:
            raise DataCheckError(f"{rank_file.path}: other tensor names than {files[0].path.name} (files of two runs?)")
    return [source_tensor(name, files, [s[name] for s in states]) for name in names]


def _extra_state(directory: Path, world_size: int, opened: list[SaveFile]) -> dict[str, Any]:
    """Open the extra state files there are (appended to `opened`); rank 0's items, plain."""
    paths = [directory / f"extra_state_world_size_{world_size}_rank_{rank}.pt" for rank in range(world_size)]
    first = len(opened)
    opened.extend(SaveFile(path, extra_state_loads) for path in paths if path.exists())  # each closed with `opened`, even on a failure
    files = opened[first:]
    if not files or files[0].path != paths[0]:
        return {}
    state = files[0].state
    if not isinstance(state, dict):
        raise DataCheckError(f"{paths[0]}: holds a {type(state).__name__}, expected a dict of named items")
    return {str(key): u.plain(value) for key, value in state.items()}
