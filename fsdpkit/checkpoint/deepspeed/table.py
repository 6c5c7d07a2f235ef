"""A DeepSpeed ZeRO checkpoint as a table of tensors whose elements lie at byte ranges of its
rank files (no torch, no deepspeed; the tensors: `sources`): what inspect, verify, convert and
diff read. Tied parameters (`shared_params`) are aliases of the name DeepSpeed kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..format.bytecopy import SourceTensor
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile
from .files import DeepSpeedFiles, resolve
from .sources import add_sources, state_entry
from .unpickler import DeepSpeedRecord, loads

FORMAT = "deepspeed"


@dataclass
class DeepSpeedCheckpoint:
    files: DeepSpeedFiles
    stage: int
    world_size: int
    precision: str  # the module's dtype (F32, BF16, F16)
    ds_version: str
    global_steps: int | None
    model: list[SourceTensor] = field(default_factory=list)
    optimizer: list[SourceTensor] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name kept
    frozen: tuple[str, ...] = ()
    buffers: tuple[str, ...] = ()
    param_groups: list[dict] = field(default_factory=list)  # hyperparameters, tensors left out
    items: dict[str, Any] = field(default_factory=dict)  # top-level non-tensor items of the model file
    loss_scaler: Any = None  # rank 0's optimizer loss scaler, as its record
    opened: list[SaveFile] = field(default_factory=list)

    @property
    def directory(self) -> Path:
        return self.files.tag_dir

    @property
    def sources(self) -> list[SourceTensor]:
        return self.model + self.optimizer

    def groups(self) -> list[dict]:
        """The optimizer's groups in fsdpkit's form (`{"settings", "params"}`): the names from
        `param_shapes`, the settings from the optimizer's groups."""
        shapes = self.items.get("param_shapes")
        if not isinstance(shapes, list) or not all(isinstance(group, dict) for group in shapes):
            raise DataCheckError(f"{self.directory}: no param_shapes per group in the model states file")
        settings = self.param_groups
        return [{"settings": settings[i] if i < len(settings) else {}, "params": list(group)} for i, group in enumerate(shapes)]

    def close(self) -> None:
        for rank_file in self.opened:
            rank_file.close()

    def __enter__(self) -> DeepSpeedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_deepspeed(path: str | os.PathLike[str]) -> DeepSpeedCheckpoint:
    """The checkpoint at `path` (save or tag directory), every rank file's pickle read and every
    parameter's place checked (DataCheckError naming what is wrong)."""
    files = resolve(path)
    opened: list[SaveFile] = []
    try:
        return _build(files, opened)
    except BaseException:
        for rank_file in opened:
            rank_file.close()
        raise


def _build(files: DeepSpeedFiles, opened: list[SaveFile]) -> DeepSpeedCheckpoint:
    for path in (*files.optim_files, *([files.model_file] if files.model_file else files.rank_model_files)):
        opened.append(SaveFile(path, loads))
    optims, models = opened[: len(files.optim_files)], opened[len(files.optim_files) :]
    head = models[0]
    version = str(head.state.get("ds_version", "unknown")) if isinstance(head.state, dict) else "unknown"
    states = [state_entry(o.state, "optimizer_state_dict", o.path, version) for o in optims]
    stage = _stage(states[0], optims[0].path, version)
    world_size = _world_size(states[0], optims[0].path, version)
    for rank_file, state in zip(optims, states, strict=True):
        if (found := _world_size(state, rank_file.path, version)) != world_size:
            raise DataCheckError(f"{rank_file.path}: saved by {found} ranks, rank 0's file by {world_size} (files of two runs?)")
        if (found := _stage(state, rank_file.path, version)) != stage:
            raise DataCheckError(f"{rank_file.path}: ZeRO stage {found}, rank 0's file stage {stage} (files of two runs?)")
    if len(optims) != world_size:
        raise DataCheckError(f"{files.tag_dir}: {len(optims)} optimizer files, the checkpoint was saved by {world_size} ranks")
    if stage == 3 and len(models) != world_size:
        raise DataCheckError(f"{files.tag_dir}: {len(models)} ZeRO-3 model files, the checkpoint was saved by {world_size} ranks")
    _same_tag(models + optims, files)
    steps = head.state.get("global_steps")
    checkpoint = DeepSpeedCheckpoint(
        files, stage, world_size, _precision(files, head), version, steps if type(steps) is int else None, opened=opened
    )
    add_sources(checkpoint, models, optims, states)
    checkpoint.loss_scaler = states[0].get("loss_scaler")
    checkpoint.items = {k: u.plain(v) for k, v in head.state.items() if k != "module" and not isinstance(v, u.TensorRecord)}
    return checkpoint


def _stage(optimizer_state: Any, where: Path, version: str) -> int:
    value = optimizer_state.get("zero_stage") if isinstance(optimizer_state, dict) else None
    value = value.value() if isinstance(value, DeepSpeedRecord) else value
    if value not in (1, 2, 3):
        raise DataCheckError(f"{where}: ZeRO stage {value!r}: a layout fsdpkit does not read (ds_version {version})")
    return int(value)


def _world_size(optimizer_state: Any, where: Path, version: str) -> int:
    value = state_entry(optimizer_state, "partition_count", where, version)
    value = max(value) if isinstance(value, list) and value else value
    if type(value) is not int or value < 1:
        raise DataCheckError(f"{where}: partition_count {value!r}: a layout fsdpkit does not read (ds_version {version})")
    return value


def _precision(files: DeepSpeedFiles, head: SaveFile) -> str:
    if files.optim_prefix:
        return files.optim_prefix.rstrip("_").upper()
    module = head.state.get("module") if isinstance(head.state, dict) else None
    records = module.values() if isinstance(module, dict) else ()
    dtypes = {r.dtype or r.storage.storage_type.dtype for r in records if isinstance(r, u.TensorRecord)}
    return "BF16" if "BF16" in dtypes else "F16" if "F16" in dtypes else "F32"


def _same_tag(rank_files: list[SaveFile], files: DeepSpeedFiles) -> None:
    steps = {rf.path.name: rf.state.get("global_steps") for rf in rank_files if isinstance(rf.state, dict) and "global_steps" in rf.state}
    if len(set(steps.values())) > 1:
        detail = ", ".join(f"{name}: {step}" for name, step in sorted(steps.items())[:4])
        raise DataCheckError(f"{files.tag_dir}: rank files of different steps ({detail}): files of two saves?")
