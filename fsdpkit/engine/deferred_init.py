"""Deferred initialisation: a model built on the meta device is materialised one unit at a
time; each rank keeps only its shard before the next unit is built.

A parameter is initialised by the model's `init_parameter(name, tensor)` when it has one
(fsdpkit's GPT does: each parameter draws from a generator seeded by the model seed and
its name, so the result equals eager initialisation whatever the order), otherwise by
`reset_parameters()` of each module holding the unit's parameters (torch FSDP's
convention). Tied weights are materialised once and stay tied.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..errors import UsageError
from .plan import UnitPlan


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Running statistics (batch norms) are recomputed; any other buffer on the meta device
    could only be guessed, so it is an error."""
    for owner_name, owner in module.named_modules():
        meta = [name for name, buffer in owner._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        if not hasattr(owner, "reset_running_stats"):
            where = f"{owner_name}.{meta[0]}" if owner_name else meta[0]
            raise UsageError(f"buffer {where!r} is on the meta device and fsdpkit cannot recompute it: "
                             "build the model eagerly (--eager-init) or give the buffer real values")
        for name in meta:
            owner._buffers[name] = torch.zeros_like(owner._buffers[name], device=device)
        owner.reset_running_stats()


def unit_materializer(root: nn.Module, device: torch.device) -> Callable[[UnitPlan], None]:
    modules = dict(root.named_modules(remove_duplicate=False))
    init_parameter = getattr(root, "init_parameter", None)

    def materialize(plan: UnitPlan) -> None:
        fresh: list[tuple[str, nn.Parameter]] = []
        for param_plan in plan.params:
            module, attr = param_plan.uses[0]
            current = modules[module]._parameters[attr]
            if not current.is_meta:
                continue
            param = nn.Parameter(torch.empty(param_plan.shape, dtype=current.dtype, device=device), requires_grad=param_plan.requires_grad)
            for use_module, use_attr in param_plan.uses:
                modules[use_module]._parameters[use_attr] = param
            fresh.append((param_plan.name, param))
        if not fresh:
            return
        with torch.no_grad():
            if callable(init_parameter):
                for name, param in fresh:
                    init_parameter(name, param)
            else:
                _reset_owners(plan, modules, fresh)

    return materialize


def _reset_owners(plan: UnitPlan, modules: dict[str, nn.Module], fresh: list[tuple[str, nn.Parameter]]) -> None:
    """torch FSDP's convention: reset_parameters() of each module holding this unit's
    parameters, when every parameter it holds is one just materialised (a module that also
    holds an already sharded parameter cannot be reset). A parameter no reset touched is an
    error, never silently uninitialised memory."""
    fresh_ids = {id(param) for _, param in fresh}
    for _, param in fresh:
        param.fill_(float("nan"))
    owners = {use_module for p in plan.params for use_module, _ in p.uses}
    for name in sorted(owners, key=lambda n: list(modules).index(n)):
        module = modules[name]
        reset = getattr(module, "reset_parameters", None)
        own = [p for p in module.parameters(recurse=False)]
        if callable(reset) and own and all(id(p) in fresh_ids for p in own):
            reset()
    untouched = [name for name, param in fresh if param.numel() and torch.isnan(param).all()]
    if untouched:
        raise UsageError(f"deferred init: nothing initialises parameter {untouched[0]!r} (its module has no reset_parameters()); "
                         "give the model init_parameter(name, tensor), or build it eagerly (--eager-init)")
