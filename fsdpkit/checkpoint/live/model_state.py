"""A sharded model and its optimizer <-> the checkpoint's tensor table (optimizer states:
optim_state.py), reading the engine only through `fsdpkit.engine.view.describe`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Set as AbstractSet

import torch
import torch.nn as nn

from ...engine.view import ShardedModelView
from ...errors import RunError
from ...flat_layout import ElementRange
from ..core.names import optim_tensor_name
from ..format.placement import TensorSpec
from .optim_state import StateLayout, kept_states, saved_states
from .tensors import RangeReader, safetensors_dtype


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {name: tensor for name, tensor in module.state_dict().items() if name not in params and "." + name not in params}


def expected_tensors(
    params: list[tuple[str, tuple[int, ...], bool]],
    module: nn.Module,
    optimizer_states: dict[str, StateLayout] | None = None,
    *,
    stateless: AbstractSet[str] = frozenset(),
) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold for a model: its `params` (name, shape, requires_grad),
    buffers, and trainable parameters' optimizer state (`stateless`: those rightly without)."""
    expected = {name: tuple(shape) for name, shape, _ in params}
    expected.update({name: tuple(t.shape) for name, t in persistent_buffers(module).items()})
    for name, shape, trainable in params:
        if trainable and name not in stateless:
            for key, scalar_shape in (optimizer_states or {}).get(name, {}).items():
                expected[optim_tensor_name(key, name)] = tuple(shape) if scalar_shape is None else scalar_shape
    return expected


def view_params(view: ShardedModelView) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(p.name, p.shape, p.requires_grad) for unit in view.units for p in unit.params]


def tensor_table(
    view: ShardedModelView, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[list[TensorSpec], dict[str, tuple[ElementRange, torch.Tensor]]]:
    """What a checkpoint of this model stores, in order: parameters (unit by unit), buffers, then
    each optimizer state; the same on every rank. And this rank's data of each: (element range
    held here, the live 1-D tensor, not a copy)."""
    table: list[TensorSpec] = []
    local: dict[str, tuple[ElementRange, torch.Tensor]] = {}
    states: dict[str, list[TensorSpec]] = {}
    for unit in view.units:
        for param in unit.params:
            table.append(TensorSpec(param.name, safetensors_dtype(param.tensor.dtype), tuple(param.shape)))
            local[param.name] = (param.fragment.param_range, param.tensor.detach().reshape(-1))
            param_state = optimizer.state.get(param.tensor, {}) if optimizer is not None else {}
            for key, name, scalar_shape, held, data in saved_states(param.name, param.fragment.param_range, param.tensor, param_state):
                shape = tuple(param.shape) if scalar_shape is None else scalar_shape
                states.setdefault(key, []).append(TensorSpec(name, safetensors_dtype(data.dtype), shape))
                local[name] = (held, data)
    for name, tensor in persistent_buffers(module).items():
        table.append(TensorSpec(name, safetensors_dtype(tensor.dtype), tuple(tensor.shape)))
        local[name] = (ElementRange(0, tensor.numel()), tensor.detach().reshape(-1))
    for specs in states.values():
        table.extend(specs)
    return table, local


def planned_numels(view: ShardedModelView, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[torch.dtype, int]:
    """Elements per dtype of this rank's `tensor_table` data once the optimizer has stepped, known
    before it has (a one-value state as float32): an upper bound, without the states of an
    optimizer that cannot tell which it keeps."""
    numels: Counter[torch.dtype] = Counter()
    layouts: dict[int, StateLayout] = {}
    if optimizer is not None:
        with contextlib.suppress(RunError):  # an optimizer that cannot tell its states gets room at the first copy
            kept = kept_states(optimizer, [])
            layouts = {id(p): layout for group, layout in zip(optimizer.param_groups, kept, strict=True) for p in group["params"]}
    for unit in view.units:
        for param in unit.params:
            numels[param.tensor.dtype] += param.tensor.numel()
            for shape in layouts.get(id(param.tensor), {}).values() if param.requires_grad else ():
                numels[param.tensor.dtype if shape is None else torch.float32] += param.tensor.numel() if shape is None else 1
    for tensor in persistent_buffers(module).values():
        numels[tensor.dtype] += tensor.numel()
    return dict(numels)


def optimizer_hyperparameters(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    if optimizer is None:
        return None
    names = {id(p): name for name, p in module.named_parameters()}
    stateless = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    groups = []
    for group in optimizer.param_groups:
        settings = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({"settings": settings, "params": [names.get(id(p), "?") for p in group["params"]]})
    return {"type": type(optimizer).__name__, "groups": groups, "stateless": stateless}


def load_weights(view: ShardedModelView, module: nn.Module, reader: RangeReader) -> None:
    with torch.no_grad():
        for unit in view.units:
            for param in unit.params:
                if param.fragment.param_range.size:
                    param.tensor.copy_(reader.read_range(param.name, param.fragment.param_range))
        for name, buffer in persistent_buffers(module).items():
            buffer.copy_(reader.read_tensor(name).to(buffer.dtype))
