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

from .plan import UnitPlan


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    for owner in module.modules():
        meta = [name for name, buffer in owner._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        for name in meta:
            owner._buffers[name] = torch.zeros_like(owner._buffers[name], device=device)
        if hasattr(owner, "reset_running_stats"):
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
                owners = {use_module for p in plan.params for use_module, _ in p.uses}
                for name in sorted(owners, key=lambda n: list(modules).index(n)):
                    reset = getattr(modules[name], "reset_parameters", None)
                    if callable(reset):
                        reset()

    return materialize
