"""Deferred initialisation: a model built on the meta device gets its values after its units
exist, one module at a time; each rank keeps only its fragments, so the peak is one module's
parameters plus the shards, never the model.

A parameter is initialised by the `init_parameter(name, tensor)` of the model's hooks
(`fsdpkit.engine.model_hooks`) when it declares one (fsdpkit's GPT does: each parameter
draws from a generator seeded by the model seed and its name, so the result equals eager
initialisation whatever the order). Otherwise by
`reset_parameters()` of the module that owns it, so that the result equals eager
construction under the same seed:

- modules are reset in the order eager construction runs their resets: children before
  parents, siblings in registration order (each module resets at the end of its __init__,
  as torch's modules do);
- each module's reset sees its own parameters at full size; a tied parameter belongs to the
  first module holding it (its canonical name), and another module sharing it draws into a
  scratch copy, so the random stream advances as in eager construction but the owner's
  values are the ones kept.

What cannot reproduce eager init is an error naming the parameter: one that no
reset_parameters() initialises, or a reset that writes a parameter of another module.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import UsageError
from .flat_unit import SHAPE_ATTR, FlatUnit
from .model_hooks import hooks_of


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters()) or any(t.is_meta for t in module.buffers())


def meta_parameter_names(module: nn.Module) -> set[str]:
    return {name for name, param in module.named_parameters() if param.is_meta}


def materialize_buffers(module: nn.Module, device: torch.device) -> None:
    """Running statistics (batch norms) are recomputed; any other buffer on the meta device
    could only be guessed, so it is an error."""
    for owner_name, owner in module.named_modules():
        meta = [name for name, buffer in owner._buffers.items() if buffer is not None and buffer.is_meta]
        if not meta:
            continue
        if not hasattr(owner, "reset_running_stats"):
            where = f"{owner_name}.{meta[0]}" if owner_name else meta[0]
            raise UsageError(
                f"buffer {where!r} is on the meta device and fsdpkit cannot recompute it: "
                "build the model eagerly (--eager-init) or give the buffer real values"
            )
        for name in meta:
            owner._buffers[name] = torch.zeros_like(owner._buffers[name], device=device)
        owner.reset_running_stats()


def initialize_meta_parameters(root: nn.Module, units: list[FlatUnit], names: set[str], device: torch.device) -> None:
    """Fill the shards of the parameters `names` (those that were on the meta device)."""
    slots = {}  # (module name, attribute) -> (unit, parameter index), for every use of a meta parameter
    for unit in units:
        for index, spec in enumerate(unit.spec.params):
            if spec.name in names:
                slots.update({use: (unit, index) for use in spec.uses})
    init_parameter = hooks_of(root).init_parameter
    if init_parameter is not None:
        with torch.no_grad():
            for unit in units:
                for index, spec in enumerate(unit.spec.params):
                    if spec.name in names:
                        full = torch.empty(spec.shape, dtype=unit.master_dtype, device=device)
                        init_parameter(spec.name, full)
                        unit.fill_parameter(index, full)
        return
    modules = dict(root.named_modules(remove_duplicate=False))
    # While modules reset, every meta parameter shows as a meta tensor of its full shape: a
    # reset that reaches into another module's parameter writes nothing, and is caught.
    placeholder_names: dict[int, str] = {}
    for unit in units:
        for spec in unit.spec.params:
            if spec.name in names:
                placeholder = nn.Parameter(
                    torch.empty(spec.shape, dtype=unit.master_dtype, device="meta"), requires_grad=spec.requires_grad
                )
                placeholder_names[id(placeholder)] = spec.name
                for module_name, attr in spec.uses:
                    modules[module_name]._parameters[attr] = placeholder
    done: set[str] = set()
    try:
        for module_name in _construction_order(root):
            _reset_module(module_name, modules[module_name], slots, device, done, placeholder_names)
    finally:
        for unit in units:
            unit.free_full()  # the attributes show the sharded fragments again
    missing = [name for unit in units for name in (p.name for p in unit.spec.params) if name in names and name not in done]
    if missing:
        raise UsageError(
            f"deferred init: nothing initialises parameter {missing[0]!r} (its module has no reset_parameters() "
            "that sets it); give the model ModelHooks(init_parameter=...) (fsdpkit.engine.model_hooks), or build it eagerly (--eager-init)"
        )


def _construction_order(root: nn.Module) -> list[str]:
    """Module names, children before their parent, each module once (its first name)."""
    order: list[str] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)
        order.append(name)

    visit("", root)
    return order


def _reset_module(
    module_name: str, module: nn.Module, slots: dict, device: torch.device, done: set[str], placeholder_names: dict[int, str]
) -> None:
    own = {attr: slots[(module_name, attr)] for attr in module._parameters if (module_name, attr) in slots}
    reset = getattr(module, "reset_parameters", None)
    if not own or not callable(reset):
        return
    placeholders = dict(module._parameters)
    owned: dict[str, torch.Tensor] = {}
    for attr, param in placeholders.items():
        if param is None:
            continue
        # Parameters this module does not own (tied, or already real) get a scratch copy.
        tensor = torch.empty(getattr(param, SHAPE_ATTR, param.shape), dtype=param.dtype, device=device)
        if attr in own:
            unit, index = own[attr]
            if unit.spec.params[index].uses[0] == (module_name, attr):
                owned[attr] = tensor.fill_(float("nan"))
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=param.requires_grad)
    guard = _MetaWriteGuard()
    try:
        with torch.no_grad(), guard:
            reset()
    finally:
        module._parameters.update(placeholders)
    if guard.written:
        where = f"{module_name}.reset_parameters()" if module_name else f"{type(module).__name__}.reset_parameters()"
        written = placeholder_names.get(id(guard.written[0]), "a parameter")
        raise UsageError(
            f"deferred init: {where} writes parameter {written!r} of another module, so the order of "
            "random draws cannot follow eager construction; give the model ModelHooks(init_parameter=...) (fsdpkit.engine.model_hooks), "
            "or build it eagerly (--eager-init)"
        )
    for attr, tensor in owned.items():
        unit, index = own[attr]
        if tensor.numel() and torch.isnan(tensor).all():
            continue  # not set by this reset
        unit.fill_parameter(index, tensor)
        done.add(unit.spec.params[index].name)


class _MetaWriteGuard(TorchDispatchMode):
    """Records in-place writes to meta tensors (another module's parameter placeholders)."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for position, argument in enumerate(func._schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor) and value.is_meta:
                self.written.append(value)
        return func(*args, **kwargs)
