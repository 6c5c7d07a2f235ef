"""A DeepSpeed ZeRO checkpoint as a table of tensors whose elements lie at byte ranges of its
rank files (no torch, no deepspeed): what inspect, verify, convert and diff read.

The model is what DeepSpeed's `zero_to_fp32.py` gives: the buffers (from the model states
file, as stored), the frozen parameters (ZeRO 1/2: whole in the model file; ZeRO 3: one
fragment per rank), and every trainable parameter as its fp32 master weights, sliced from the
optimizer files' flat partitions (`partition`). Tied parameters (`shared_params`) are aliases
of the name DeepSpeed kept. The optimizer state is Adam's moments under fsdpkit's names
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`, laid out as the fp32 partitions) and its
`step` per parameter group (`optim.step.<name>`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from ..core.names import optim_tensor_name
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, TensorRange, open_each
from . import partition as f
from .files import DeepSpeedFiles, resolve
from .unpickler import DeepSpeedRecord, loads

FORMAT = "deepspeed"
MOMENTS = ("exp_avg", "exp_avg_sq")
EVERY_RANK_MODEL_KEYS = ("global_steps", "frozen_param_fragments")  # what is read of every rank's model states file


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
    def open_rank_file(number: int, path: Path) -> SaveFile:
        rank_file = SaveFile(path, loads)
        if number > len(files.optim_files) and isinstance(rank_file.state, dict):
            # Rank 0's model states file is read whole; of the others' (ZeRO-3: one each, with a
            # record per parameter) only these, kept as each is opened, not N copies.
            rank_file.state = {key: value for key, value in rank_file.state.items() if key in EVERY_RANK_MODEL_KEYS}
        return rank_file

    open_each((*files.optim_files, *files.model_files), open_rank_file, opened)
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


def state_entry(state: Any, key: str, where: Path, ds_version: str) -> Any:
    if not isinstance(state, dict) or key not in state:
        raise DataCheckError(f"{where}: no {key!r}: a layout fsdpkit does not read (ds_version {ds_version})")
    return state[key]


def _param_shapes(state: dict, where: Path, version: str) -> list[dict[str, tuple[int, ...]]]:
    value = state_entry(state, "param_shapes", where, version)
    groups = value if isinstance(value, list) else [value]
    if not all(isinstance(g, dict) and all(isinstance(s, tuple) for s in g.values()) for g in groups):
        raise DataCheckError(f"{where}: param_shapes is not a list of name -> shape: a layout fsdpkit does not read (ds_version {version})")
    return groups


def _whole(name: str, shape: tuple[int, ...], where: TensorRange) -> SourceTensor:
    return SourceTensor(name, shape, where.dtype, (where.piece(name, 0, where.numel, 0),))


def _dict(value: Any, what: str, where: SaveFile, version: str) -> dict:
    if not isinstance(value, dict):
        raise DataCheckError(f"{where.path}: {what} is not a dict: a layout fsdpkit does not read (ds_version {version})")
    return value


def add_sources(checkpoint: DeepSpeedCheckpoint, models: list[SaveFile], optims: list[SaveFile], states: list[Any]) -> None:
    """`states`: each optimizer file's `optimizer_state_dict`."""
    version = checkpoint.ds_version
    head = models[0]
    state = _dict(head.state, "the model states", head, version)
    module = _dict(state.get("module"), "'module'", head, version)
    buffers = [
        _whole(name, record.shape, head.tensor_range(record, f"buffer {name!r}"))
        for name in state.get("buffer_names") or []
        if isinstance(record := module.get(name), u.TensorRecord)
    ]
    checkpoint.buffers = tuple(s.name for s in buffers)
    frozen = _frozen(checkpoint, models)
    checkpoint.frozen = tuple(s.name for s in frozen)
    param_shapes = _param_shapes(state, head.path, version)
    trainable, slots = _trainable(checkpoint.stage, param_shapes, optims, states, version)
    checkpoint.model = buffers + frozen + trainable
    shared = state.get("shared_params") or {}
    names = {s.name for s in checkpoint.model}
    checkpoint.aliases = {str(a): str(c) for a, c in shared.items() if c in names and a not in names}
    checkpoint.optimizer, checkpoint.param_groups = _moments(checkpoint.stage, optims, states, slots, param_shapes)


def _frozen(checkpoint: DeepSpeedCheckpoint, models: list[SaveFile]) -> list[SourceTensor]:
    head = models[0]
    shapes = head.state.get("frozen_param_shapes")
    if shapes is None and checkpoint.stage <= 2:
        # Stage 1 lists no frozen parameters: they are the module's tensors that are neither
        # trained (`param_shapes`), buffers nor tied names.
        trained = {name for group in (head.state.get("param_shapes") or []) if isinstance(group, dict) for name in group}
        skip = trained | set(checkpoint.buffers) | set(head.state.get("shared_params") or {})
        return [
            _whole(name, tuple(record.shape), head.tensor_range(record, f"frozen parameter {name!r}"))
            for name, record in (head.state.get("module") or {}).items()
            if isinstance(record, u.TensorRecord) and name not in skip
        ]
    out = []
    for name, shape in (shapes or {}).items():
        what = f"frozen parameter {name!r}"
        if checkpoint.stage <= 2:
            where = head.tensor_range((head.state.get("frozen_param_fragments") or {}).get(name), what)
            if where.numel != math.prod(shape):
                raise DataCheckError(f"{head.path}: frozen parameter {name!r} holds {where.numel} elements, its shape {list(shape)}")
            out.append(_whole(name, tuple(shape), where))
        else:
            ranges = [m.tensor_range((m.state.get("frozen_param_fragments") or {}).get(name), what) for m in models]
            flats = tuple(f.Flat((r,)) for r in ranges)
            f.check_fits(3, [f.ZeroSlot(name, tuple(shape), 0, 0)], flats)
            out.append(f.ZeroSource(name, tuple(shape), ranges[0].dtype, stage=3, slot=f.ZeroSlot(name, tuple(shape), 0, 0), flats=flats))
    return out


def _group_list(value: Any, what: str, where: SaveFile, version: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, u.TensorRecord) for v in value):
        raise DataCheckError(f"{where.path}: {what} is not a list of tensors: a layout fsdpkit does not read (ds_version {version})")
    return value


def _trainable(stage, param_shapes, optims, states, version):  # type: ignore[no-untyped-def]
    """The fp32 masters: ZeRO 1/2's `single_partition_of_fp32_groups`, ZeRO 3's `fp32_flat_groups`."""
    key, what = ("single_partition_of_fp32_groups", "fp32 partition of group") if stage <= 2 else ("fp32_flat_groups", "fp32 flat group")
    per_rank = [
        [o.tensor_range(t, f"{what} {g}") for g, t in enumerate(_group_list(s.get(key), key, o, version))]
        for o, s in zip(optims, states, strict=True)
    ]
    flats = f.flats_of(stage, per_rank)
    if stage <= 2:
        slots = f.zero12_slots(param_shapes, [g.numel for g in flats], len(optims))
    else:
        sizes = {fl.numel for fl in flats}
        if len(sizes) != 1:
            raise DataCheckError(f"{optims[0].path.parent}: the ranks' fp32 partitions differ in size ({sorted(sizes)})")
        slots = f.zero3_slots(param_shapes, sizes.pop(), len(optims))
    f.check_fits(stage, slots, flats)
    return [f.ZeroSource(s.name, s.shape, "F32", stage=stage, slot=s, flats=flats) for s in slots], slots


def _moments(stage, optims, states, slots, param_shapes):  # type: ignore[no-untyped-def]
    """Adam's moments, laid out as the fp32 partitions, and the step of each group."""
    bases = [s.get("base_optimizer_state", s.get("optimizer_state_dict")) for s in states]
    per_group = [_group_states(b, len(param_shapes)) for b in bases]
    if any(p is None for p in per_group):
        return [], _param_groups(bases[0])
    out: list[SourceTensor] = []
    for key in MOMENTS:
        if all(key in group for rank in per_group for group in rank):
            per_rank = [
                [o.tensor_range(group[key], f"{key} of group {g}") for g, group in enumerate(rank)]
                for o, rank in zip(optims, per_group, strict=True)
            ]
            flats = f.flats_of(stage, per_rank)
            f.check_fits(stage, slots, flats)
            out += [f.ZeroSource(optim_tensor_name(key, s.name), s.shape, "F32", stage=stage, slot=s, flats=flats) for s in slots]
    group_of = {name: g for g, shapes in enumerate(param_shapes) for name in shapes}
    for slot in slots:
        step = per_group[0][group_of[slot.name]].get("step")
        if isinstance(step, u.TensorRecord):
            out.append(_whole(optim_tensor_name("step", slot.name), (), optims[0].tensor_range(step, "step")))
    return out, _param_groups(bases[0])


def _group_states(base: Any, groups: int) -> list[dict] | None:
    found = base if isinstance(base, list) and len(base) == groups else None
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        found = [base["state"].get(g) for g in range(groups)]
    return found if found is not None and all(isinstance(g, dict) for g in found) else None


def _param_groups(base: Any) -> list[dict]:
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list):
        return []
    return [{k: u.plain(v) for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
