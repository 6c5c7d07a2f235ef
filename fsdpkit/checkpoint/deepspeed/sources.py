"""The tensors of a DeepSpeed checkpoint as `SourceTensor`s. The model is what DeepSpeed's
`zero_to_fp32.py` gives: the buffers (from the model states file, as stored), the frozen
parameters (ZeRO 1/2: whole in the model file; ZeRO 3: one fragment per rank), and every
trainable parameter as its fp32 master weights, sliced from the optimizer files' flat
partitions (`partition`). The optimizer state is Adam's moments under fsdpkit's names
(`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`, laid out as the fp32 partitions) and its
`step` per parameter group (`optim.step.<name>`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..format.bytecopy import SourcePiece, SourceTensor
from ..format.names import optim_tensor_name
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, TensorRange
from . import partition as f

if TYPE_CHECKING:
    from .table import DeepSpeedCheckpoint

MOMENTS = ("exp_avg", "exp_avg_sq")


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
    nbytes = where.numel * dtype_info(where.dtype).itemsize
    return SourceTensor(
        name, shape, where.dtype, (SourcePiece(ElementRange(0, where.numel), where.path, where.offset, nbytes, None, name),)
    )


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


def _module_only(head: SaveFile, buffers: set[str]) -> list[SourceTensor]:
    """Stage 1 lists no frozen parameters (`frozen_param_shapes` None): they are the module's
    tensors that are neither trained (`param_shapes`), buffers nor tied names."""
    state = head.state
    trained = {name for group in (state.get("param_shapes") or []) if isinstance(group, dict) for name in group}
    skip = trained | buffers | set(state.get("shared_params") or {})
    return [
        _whole(name, tuple(record.shape), head.tensor_range(record, f"frozen parameter {name!r}"))
        for name, record in (state.get("module") or {}).items()
        if isinstance(record, u.TensorRecord) and name not in skip
    ]


def _frozen(checkpoint: DeepSpeedCheckpoint, models: list[SaveFile]) -> list[SourceTensor]:
    head = models[0]
    shapes = head.state.get("frozen_param_shapes")
    if shapes is None and checkpoint.stage <= 2:
        return _module_only(head, set(checkpoint.buffers))
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
            pieces = f.slot_pieces(3, f.ZeroSlot(name, tuple(shape), 0, 0), [f.Flat((r,)) for r in ranges])
            out.append(SourceTensor(name, tuple(shape), ranges[0].dtype, tuple(pieces)))
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
    return [SourceTensor(s.name, s.shape, "F32", tuple(f.slot_pieces(stage, s, flats))) for s in slots], slots


def _base_state(state: dict) -> Any:
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        if key in state:
            return state[key]
    return None


def _moments(stage, optims, states, slots, param_shapes):  # type: ignore[no-untyped-def]
    """Adam's moments, laid out as the fp32 partitions, and the step of each group."""
    bases = [_base_state(s) for s in states]
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
            out += [SourceTensor(optim_tensor_name(key, s.name), s.shape, "F32", tuple(f.slot_pieces(stage, s, flats))) for s in slots]
    group_of = {name: g for g, shapes in enumerate(param_shapes) for name in shapes}
    for slot in slots:
        step = per_group[0][group_of[slot.name]].get("step")
        if isinstance(step, u.TensorRecord):
            out.append(_whole(optim_tensor_name("step", slot.name), (), optims[0].tensor_range(step, "step")))
    return out, _param_groups(bases[0])


def _group_states(base: Any, groups: int) -> list[dict] | None:
    if isinstance(base, list) and len(base) == groups and all(isinstance(g, dict) for g in base):
        return base
    if isinstance(base, dict) and isinstance(base.get("state"), dict):
        state = base["state"]
        found = [state.get(g) for g in range(groups)]
        if all(isinstance(g, dict) for g in found):
            return found  # type: ignore[return-value]
    return None


def _param_groups(base: Any) -> list[dict]:
    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list):
        return []
    return [{k: u.plain(v) for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
