"""Which modules are units and which parameters each unit's flat parameter holds.

Pure over the module tree: no process group, works on a model built on the meta device.
A parameter that several modules share (tied weights) is placed once, in the lowest unit
that contains every module using it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from ..errors import UsageError
from ..layout import FlatLayout


@dataclass(frozen=True)
class WrapPolicy:
    """Picks the modules that become units. The root is always a unit and takes the rest.

    With no rule given, each element of every nn.ModuleList is a unit.
    """

    module_classes: tuple[type[nn.Module], ...] = ()
    predicate: Callable[[str, nn.Module], bool] | None = None
    min_params: int | None = None

    def __post_init__(self) -> None:
        if self.min_params is not None and self.min_params < 1:
            raise UsageError(f"wrap min_params must be >= 1, got {self.min_params}")

    @property
    def uses_module_list_rule(self) -> bool:
        return not self.module_classes and self.predicate is None and self.min_params is None

    def selects(self, name: str, module: nn.Module, parent: nn.Module | None) -> bool:
        if self.module_classes and isinstance(module, self.module_classes):
            return True
        if self.predicate is not None and self.predicate(name, module):
            return True
        if self.min_params is not None and not isinstance(module, nn.ModuleList):
            if sum(p.numel() for p in module.parameters()) >= self.min_params:
                return True
        return self.uses_module_list_rule and isinstance(parent, nn.ModuleList)


@dataclass(frozen=True)
class ParamPlan:
    name: str  # the canonical name: the first in named_parameters() order
    shape: tuple[int, ...]
    uses: tuple[tuple[str, str], ...]  # (module name, attribute) of every module holding it
    requires_grad: bool


@dataclass(frozen=True)
class UnitPlan:
    name: str  # module name, "" for the root
    params: tuple[ParamPlan, ...] = field(default_factory=tuple)

    def layout(self, shard_factor: int) -> FlatLayout:
        return FlatLayout.from_shapes([(p.name, p.shape) for p in self.params], shard_factor)


def _within(module_name: str, unit_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def plan_units(root: nn.Module, policy: WrapPolicy) -> list[UnitPlan]:
    """Units in module pre-order (root first), each with its parameters in named order.

    Units that end up with no parameters are left out.
    """
    parents: dict[str, nn.Module | None] = {"": None}
    unit_names = [""]
    for name, module in root.named_modules():
        for child_name, child in module.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = module
    for name, module in root.named_modules():
        if name and policy.selects(name, module, parents.get(name)):
            unit_names.append(name)

    uses: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None and (module_name, attr) not in uses.setdefault(id(param), []):
                uses[id(param)].append((module_name, attr))

    members: dict[str, list[ParamPlan]] = {name: [] for name in unit_names}
    for name, param in root.named_parameters():
        param_uses = uses[id(param)]
        owner = max(
            (unit for unit in unit_names if all(_within(m, unit) for m, _ in param_uses)),
            key=lambda unit: (unit.count(".") + (unit != ""), len(unit)),
        )
        members[owner].append(ParamPlan(name, tuple(param.shape), tuple(param_uses), param.requires_grad))
    return [UnitPlan(name, tuple(members[name])) for name in unit_names if members[name]]


def default_policy_for_model(model_name: str) -> WrapPolicy:
    from ..models.registry import default_unit_classes

    classes = default_unit_classes(model_name)
    return WrapPolicy(module_classes=classes) if classes else WrapPolicy()


def unit_plan_for_model(name: str, world_size: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The flat-parameter plan of a model by name under its default wrap policy, built on
    the meta device: a list of units, each an ordered list of (parameter name, shape).

    `world_size` is validated here; lay a unit out with FlatLayout.from_shapes(unit, world_size).
    """
    from ..models.registry import build_model

    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    model = build_model(name, device="meta")
    return [[(p.name, p.shape) for p in unit.params] for unit in plan_units(model, default_policy_for_model(name))]
