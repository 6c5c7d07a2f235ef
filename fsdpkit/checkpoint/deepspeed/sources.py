"""The tensors of a DeepSpeed checkpoint as `SourceTensor`s (see `table`): model (buffers,
frozen, fp32 masters) and optimizer (Adam's moments and step) under fsdpkit's names."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..format.bytecopy import SourcePiece, SourceTensor
from ..format.names import optim_tensor_name
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, TensorRange
from . import flat as f

if TYPE_CHECKING:
    from .table import DeepSpeedCheckpoint

MOMENTS = ("exp_avg", "exp_avg_sq")


def _whole(name: str, shape: tuple[int, ...], where: TensorRange) -> SourceTensor:
    piece = SourcePiece(ElementRange(0, where.numel), where.path, where.offset, where.numel * _itemsize(where.dtype), None, name)
    return SourceTensor(name, shape, where.dtype, (piece,))


def _itemsize(dtype: str) -> int:
    from ...dtypes import dtype_info

    return dtype_info(dtype).itemsize


def _dict(value: Any, what: str, where: SaveFile, version: str) -> dict:
    if not isinstance(value, dict):
        raise DataCheckError(f"{where.path}: {what} is not a dict: a layout fsdpkit does not read (ds_version {version})")
    return value


def add_sources(checkpoint: DeepSpeedCheckpoint, models: list[SaveFile], optims: list[SaveFile]) -> None:
    version = checkpoint.ds_version
    head = models[0]
    state = _dict(head.state, "the model states", head, version)
    module = _dict(state.get("module"), "'module'", head, version)
    buffer_names = state.get("buffer_names") or []
    model: list[SourceTensor] = []
    for name in buffer_names:
        record = module.get(name)
        if isinstance(record, u.TensorRecord):
            model.append(_whole(name, record.shape, head.tensor_range(record, f"buffer {name!r}")))
    checkpoint.buffers = tuple(s.name for s in model)
    frozen = _frozen(checkpoint, models)
    checkpoint.frozen = tuple(s.name for s in frozen)
    from .table import param_shapes_of, state_entry

    param_shapes = param_shapes_of(state_entry(state, "param_shapes", head.path, version), head.path, version)
    optimizer_states = [state_entry(o.state, "optimizer_state_dict", o.path, version) for o in optims]
    if checkpoint.stage <= 2:
        trainable, slots, flats = _zero12(param_shapes, optims, optimizer_states, version)
    else:
        trainable, slots, flats = _zero3(param_shapes, optims, optimizer_states, version)
    checkpoint.model = model + frozen + trainable
    shared = state.get("shared_params") or {}
    names = {s.name for s in checkpoint.model}
    checkpoint.aliases = {str(a): str(c) for a, c in shared.items() if c in names and a not in names}
    checkpoint.optimizer, checkpoint.param_groups = _moments(checkpoint, optims, optimizer_states, slots, flats, param_shapes)


def _module_only(head: SaveFile, buffers: set[str]) -> dict[str, tuple[int, ...]]:
    """Stage 1 lists no frozen parameters (`frozen_param_shapes` None): they are the module's
    tensors that are neither trained (`param_shapes`), buffers nor tied names."""
    state = head.state
    trained = {name for group in (state.get("param_shapes") or []) if isinstance(group, dict) for name in group}
    shared = state.get("shared_params") or {}
    module = state.get("module") or {}
    return {
        name: tuple(record.shape)
        for name, record in module.items()
        if isinstance(record, u.TensorRecord) and name not in trained and name not in buffers and name not in shared
    }


def _frozen(checkpoint: DeepSpeedCheckpoint, models: list[SaveFile]) -> list[SourceTensor]:
    shapes = models[0].state.get("frozen_param_shapes")
    if shapes is None and checkpoint.stage <= 2:
        return [
            _whole(name, shape, models[0].tensor_range(models[0].state["module"][name], f"frozen parameter {name!r}"))
            for name, shape in _module_only(models[0], set(checkpoint.buffers)).items()
        ]
    shapes = shapes or {}
    out = []
    for name, shape in shapes.items():
        total = math.prod(shape)
        if checkpoint.stage <= 2:
            record = (models[0].state.get("frozen_param_fragments") or {}).get(name)
            where = models[0].tensor_range(record, f"frozen parameter {name!r}")
            if where.numel != total:
                raise DataCheckError(f"{models[0].path}: frozen parameter {name!r} holds {where.numel} elements, its shape {list(shape)}")
            out.append(_whole(name, tuple(shape), where))
            continue
        ranges = [m.tensor_range((m.state.get("frozen_param_fragments") or {}).get(name), f"frozen parameter {name!r}") for m in models]
        flats = [f.Flat((r,)) for r in ranges]
        slot = f.ZeroSlot(name, tuple(shape), 0, 0)
        pieces = f.zero3_pieces(slot, flats)
        out.append(SourceTensor(name, tuple(shape), ranges[0].dtype, tuple(pieces)))
    return out


def _group_list(value: Any, what: str, where: SaveFile, version: str) -> list:
    if not isinstance(value, list) or not all(isinstance(v, u.TensorRecord) for v in value):
        raise DataCheckError(f"{where.path}: {what} is not a list of tensors: a layout fsdpkit does not read (ds_version {version})")
    return value


def _zero12(param_shapes, optims, states, version):  # type: ignore[no-untyped-def]
    per_rank = [
        [
            o.tensor_range(t, f"fp32 partition of group {g}")
            for g, t in enumerate(_group_list(s.get("single_partition_of_fp32_groups"), "single_partition_of_fp32_groups", o, version))
        ]
        for o, s in zip(optims, states, strict=True)
    ]
    groups = [f.Flat(tuple(rank[g] for rank in per_rank)) for g in range(len(per_rank[0]))]
    slots = f.zero12_slots(param_shapes, [g.numel for g in groups], len(optims))
    trainable = [SourceTensor(s.name, s.shape, "F32", tuple(f.zero12_pieces(s, groups))) for s in slots]
    return trainable, slots, groups


def _zero3(param_shapes, optims, states, version):  # type: ignore[no-untyped-def]
    flats = [
        f.Flat(
            tuple(
                o.tensor_range(t, f"fp32 flat group {g}")
                for g, t in enumerate(_group_list(s.get("fp32_flat_groups"), "fp32_flat_groups", o, version))
            )
        )
        for o, s in zip(optims, states, strict=True)
    ]
    sizes = {fl.numel for fl in flats}
    if len(sizes) != 1:
        raise DataCheckError(f"{optims[0].path.parent}: the ranks' fp32 partitions differ in size ({sorted(sizes)})")
    slots = f.zero3_slots(param_shapes, sizes.pop(), len(optims))
    trainable = [SourceTensor(s.name, s.shape, "F32", tuple(f.zero3_pieces(s, flats))) for s in slots]
    return trainable, slots, flats


def _base_state(state: dict) -> Any:
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        if key in state:
            return state[key]
    return None


def _moments(checkpoint, optims, states, slots, flats, param_shapes):  # type: ignore[no-untyped-def]
    """Adam's moments, laid out as the fp32 partitions, and the step of each group."""
    bases = [_base_state(s) for s in states]
    group_of = {name: g for g, shapes in enumerate(param_shapes) for name in shapes}
    per_group = [_group_states(b, len(param_shapes)) for b in bases]
    if any(p is None for p in per_group):
        return [], _param_groups(bases[0])
    out: list[SourceTensor] = []
    for key in MOMENTS:
        if not all(key in group for rank in per_group for group in rank):
            continue
        if checkpoint.stage <= 2:
            moment_flats = [
                f.Flat(tuple(o.tensor_range(rank[g][key], f"{key} of group {g}") for o, rank in zip(optims, per_group, strict=True)))
                for g in range(len(param_shapes))
            ]
            for slot in slots:
                out.append(SourceTensor(optim_tensor_name(key, slot.name), slot.shape, "F32", tuple(f.zero12_pieces(slot, moment_flats))))
        else:
            moment_flats = [
                f.Flat(tuple(o.tensor_range(group[key], f"{key} of group {g}") for g, group in enumerate(rank)))
                for o, rank in zip(optims, per_group, strict=True)
            ]
            for slot in slots:
                out.append(SourceTensor(optim_tensor_name(key, slot.name), slot.shape, "F32", tuple(f.zero3_pieces(slot, moment_flats))))
    for slot in slots:
        step = per_group[0][group_of[slot.name]].get("step")
        if isinstance(step, u.TensorRecord):
            where = optims[0].tensor_range(step, "step")
            out.append(_whole(optim_tensor_name("step", slot.name), (), where))
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
    from ..torchfile.unpickler import plain

    groups = base.get("param_groups") if isinstance(base, dict) else None
    if not isinstance(groups, list):
        return []
    return [{k: plain(v) for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
