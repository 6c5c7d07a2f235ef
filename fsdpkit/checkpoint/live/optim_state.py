"""Any torch optimizer's per-parameter state <-> the checkpoint's tensor table, as
`optim.<state>.<param>` (docs/checkpoint-format.md): laid out like its parameter's 1-D fragment
(Adam's exp_avg, SGD's momentum_buffer...), or one value stored whole (Adam's step).

Which states an optimizer keeps, and in which layout, is found by one step of a throwaway
optimizer of the same class and group settings over a two-element stand-in per group
(`kept_states`). The loaded state goes through the optimizer's own `load_state_dict`, which
places and casts it as torch does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ...errors import DataCheckError, RunError
from ...flat_layout import ElementRange
from ..core.names import optim_tensor_name, split_optim_tensor_name
from .tensors import RangeReader

Shape = tuple[int, ...]
# state name -> None: laid out like its parameter; a shape: one value of that shape
StateLayout = dict[str, Shape | None]


def kept_states(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> list[StateLayout]:
    """For each param group of `optimizer`, the states it keeps under the saved run's settings."""
    stand_ins = []
    for group in optimizer.param_groups:
        like = group["params"][0] if group["params"] else torch.empty(0)
        device = torch.device("cpu") if like.device.type == "meta" else like.device
        stand_in = torch.zeros(2, dtype=like.dtype, device=device, requires_grad=True)
        stand_in.grad = torch.zeros_like(stand_in)
        stand_ins.append(stand_in)
    settings = [{**settings, "params": [p]} for settings, p in zip(restored_settings(optimizer, saved_groups), stand_ins, strict=True)]
    cls: Any = type(optimizer)  # a torch.optim class takes its param groups and defaults the rest
    try:
        throwaway = cls(settings)
        throwaway.step()
    except Exception as error:
        raise RunError(
            f"cannot tell which state {cls.__name__} keeps: one built from its param groups alone could not step ({error})"
        ) from None
    layouts = []
    for stand_in in stand_ins:
        layout: StateLayout = {}
        for key, value in throwaway.state.get(stand_in, {}).items():
            if isinstance(value, torch.Tensor):
                layout[key] = None if value.shape == stand_in.shape else tuple(value.shape)
        layouts.append(layout)
    return layouts


def states_to_load(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], training_state: dict, stored: Iterable[str], *, where: str
) -> dict[str, StateLayout]:
    """Parameter name (`names`: by id of the tensor the optimizer holds) -> the states the
    optimizer keeps for it under the saved run's settings. A `stored` state of a parameter it
    holds, which it would not keep, is a DataCheckError naming it."""
    layouts = kept_states(optimizer, saved_groups(training_state))
    states = {
        names[id(p)]: layout
        for group, layout in zip(optimizer.param_groups, layouts, strict=True)
        for p in group["params"]
        if id(p) in names
    }
    for name in stored:
        parsed = split_optim_tensor_name(name)
        if parsed is not None and parsed[1] in states and parsed[0] not in states[parsed[1]]:
            kept = ", ".join(states[parsed[1]]) or "none"
            raise DataCheckError(
                f"{where}: saved optimizer state {name!r} is not one this {type(optimizer).__name__} keeps (it keeps: {kept}); "
                f"saved with another optimizer or settings?"
            )
    return states


def saved_states(
    name: str, fragment: ElementRange, shard: torch.Tensor, state: Mapping[str, Any]
) -> Iterable[tuple[str, str, Shape | None, ElementRange, torch.Tensor]]:
    """(state, stored name, None or a one-value state's shape, element range held here, 1-D data) of
    each state of one parameter (`shard`: this rank's `fragment` of it)."""
    for key, value in state.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise RunError(f"optimizer state {key!r} of {name} is a {type(value).__name__}, not a tensor: it cannot be saved")
        if value.shape == shard.shape and value.dim() == 1:
            yield key, optim_tensor_name(key, name), None, fragment, value.detach()
        elif value.numel() == 1:
            yield key, optim_tensor_name(key, name), tuple(value.shape), ElementRange(0, 1), value.detach().reshape(1)
        else:
            raise RunError(
                f"optimizer state {key!r} of {name} has shape {list(value.shape)}: only states shaped like "
                f"the parameter's shard {list(shard.shape)} or single values can be saved"
            )


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    params: Iterable[tuple[str, ElementRange, torch.Tensor]],
    states: Mapping[str, StateLayout],
    training_state: dict,
    stored: set[str],
    reader: RangeReader,
) -> None:
    """Give `optimizer` the saved run's group settings and the stored state of each parameter
    (name, this rank's fragment, the tensor the optimizer holds), through its own load_state_dict."""
    for group, settings in zip(optimizer.param_groups, restored_settings(optimizer, saved_groups(training_state)), strict=True):
        group.update(settings)
    state_dict = optimizer.state_dict()
    index = {
        id(p): i
        for group, packed in zip(optimizer.param_groups, state_dict["param_groups"], strict=True)
        for p, i in zip(group["params"], packed["params"], strict=True)
    }
    state_dict["state"] = {}
    for name, fragment, tensor in params:
        param_state = {}
        for key, scalar_shape in states.get(name, {}).items():
            stored_name = optim_tensor_name(key, name)
            if stored_name in stored and scalar_shape is not None:
                param_state[key] = reader.read_tensor(stored_name).reshape(scalar_shape)
            elif stored_name in stored:
                param_state[key] = reader.read_range(stored_name, fragment)
        if param_state:
            state_dict["state"][index[id(tensor)]] = param_state
    optimizer.load_state_dict(state_dict)


def saved_groups(training_state: dict) -> list[dict]:
    return (training_state.get("optimizer") or {}).get("groups") or []


def restored_settings(optimizer: torch.optim.Optimizer, saved_groups: list[dict]) -> list[dict]:
    """Each param group's settings (not its params) with the saved run's values, except the
    learning rate (the schedule sets it); the saved run's groups may differ in number."""
    restored = []
    for i, group in enumerate(optimizer.param_groups):
        settings = {key: value for key, value in group.items() if key != "params"}
        for key, value in (saved_groups[i].get("settings", {}) if i < len(saved_groups) else {}).items():
            if key in settings and key != "lr":
                settings[key] = tuple(value) if isinstance(settings[key], tuple) else value
        restored.append(settings)
    return restored
