"""Which modules are units and which parameters each unit's flat parameter holds.

Pure over the module tree: no process group, works on a model built on the meta device.
A parameter that several modules share (tied weights) is placed once, in the lowest unit
that contains every module using it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.nn as nn

from ..errors import UsageError
from ..flat_layout import FlatLayout


@dataclass(frozen=True)
class WrapPolicy:
    """Picks the modules that become units. The root is always a unit and takes the rest.

    module_classes / predicate: modules of those classes, or for which predicate(name,
    module) is true. min_params: bottom-up, a module whose parameters not already in a
    nested unit number at least min_params (torch's size-based policy). With none of these
    given, each element of every nn.ModuleList is a unit. every: K consecutive selected
    siblings (e.g. transformer blocks) form one unit.
    """

    module_classes: tuple[type[nn.Module], ...] = ()
    predicate: Callable[[str, nn.Module], bool] | None = None
    min_params: int | None = None
    every: int = 1

    def __post_init__(self) -> None:
        if self.min_params is not None and self.min_params < 1:
            raise UsageError(f"wrap min_params must be >= 1, got {self.min_params}")
        if self.every < 1:
            raise UsageError(f"wrap every must be >= 1, got {self.every}")

    @property
    def uses_module_list_rule(self) -> bool:
        return not self.module_classes and self.predicate is None and self.min_params is None

    def selects(self, name: str, module: nn.Module, parent: nn.Module | None) -> bool:
        if self.module_classes and isinstance(module, self.module_classes):
            return True
        if self.predicate is not None and self.predicate(name, module):
            return True
        return self.uses_module_list_rule and isinstance(parent, nn.ModuleList)


@dataclass(frozen=True)
class ParamSpec:
    name: str  # the canonical name: the first in named_parameters() order
    shape: tuple[int, ...]
    uses: tuple[tuple[str, str], ...]  # (module name, attribute) of every module holding it
    requires_grad: bool


@dataclass(frozen=True)
class UnitSpec:
    """One unit: its member modules (one, or K consecutive siblings) and its parameters."""

    members: tuple[str, ...]  # module names, "" for the root
    params: tuple[ParamSpec, ...] = field(default_factory=tuple)

    @property
    def name(self) -> str:
        return "+".join(self.members)

    def layout(self, shard_factor: int) -> FlatLayout:
        return FlatLayout.from_shapes([(p.name, p.shape) for p in self.params], shard_factor)


def _within(module_name: str, unit_name: str) -> bool:
    return unit_name == "" or module_name == unit_name or module_name.startswith(unit_name + ".")


def _depth(name: str) -> int:
    return name.count(".") + 1 if name else 0


def _select_modules(root: nn.Module, policy: WrapPolicy) -> list[str]:
    parents: dict[str, nn.Module | None] = {"": None}
    for name, module in root.named_modules():
        for child_name, _ in module.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = module
    selected = [name for name, module in root.named_modules() if name and policy.selects(name, module, parents.get(name))]
    if policy.min_params is not None:
        selected_set = set(selected)
        claimed: set[int] = set()
        order = list(root.named_modules())
        for name, module in reversed(order):  # children before parents
            if not name or isinstance(module, nn.ModuleList):
                continue
            own = [p for p in module.parameters() if id(p) not in claimed]
            if name in selected_set or sum(p.numel() for p in own) >= policy.min_params:
                selected_set.add(name)
                claimed.update(id(p) for p in own)
        selected = [name for name, _ in order if name in selected_set]
    return selected


def _group_consecutive(selected: list[str], every: int) -> list[tuple[str, ...]]:
    """Group K consecutive siblings (same parent, adjacent in the selection) into one unit."""
    groups: list[list[str]] = []
    for name in selected:
        parent = name.rpartition(".")[0]
        last = groups[-1] if groups else None
        if last and len(last) < every and last[-1].rpartition(".")[0] == parent and not _within(name, last[-1]):
            last.append(name)
        else:
            groups.append([name])
    return [tuple(group) for group in groups]


def split_units(root: nn.Module, policy: WrapPolicy) -> list[UnitSpec]:
    """Units in module pre-order (root first), each with its parameters in named order.

    Units that end up with no parameters are left out.
    """
    members_of = [("",)] + _group_consecutive(_select_modules(root, policy), policy.every)

    uses: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is not None and (module_name, attr) not in uses.setdefault(id(param), []):
                uses[id(param)].append((module_name, attr))

    def owner_depth(members: tuple[str, ...]) -> tuple[int, int]:
        return (max(_depth(m) for m in members), len(members[0]))

    params_of: dict[tuple[str, ...], list[ParamSpec]] = {members: [] for members in members_of}
    for name, param in root.named_parameters():
        param_uses = uses[id(param)]
        owner = max(
            (members for members in members_of if all(any(_within(m, member) for member in members) for m, _ in param_uses)),
            key=owner_depth,
        )
        params_of[owner].append(ParamSpec(name, tuple(param.shape), tuple(param_uses), param.requires_grad))
    return [UnitSpec(members, tuple(params_of[members])) for members in members_of if params_of[members]]


def _nested(a: str, b: str) -> bool:
    return _within(a, b) or _within(b, a)


def bucket_units(root: nn.Module, specs: list[UnitSpec], bucket_bytes: int) -> list[UnitSpec]:
    """Consecutive non-root units each smaller than `bucket_bytes` (their parameters' bytes)
    merged into one unit, so they gather and reduce in one collective each, until the
    merged unit reaches `bucket_bytes`. Units nested in one another, or of other dtypes, are
    never merged (a unit reshards after its last member's forward). 0: no bucketing."""
    if bucket_bytes <= 0:
        return specs

    def size_and_dtype(spec: UnitSpec) -> tuple[int, object]:
        params = [root.get_parameter(p.name) for p in spec.params]
        return sum(p.numel() * p.element_size() for p in params), params[0].dtype

    merged: list[UnitSpec] = []
    open_bytes, open_dtype = 0, None  # of merged[-1] while it can take more units
    for spec in specs:
        size, dtype = size_and_dtype(spec)
        small = spec.members != ("",) and size < bucket_bytes
        last = merged[-1] if merged else None
        joins = (
            small
            and last is not None
            and open_dtype == dtype
            and open_bytes + size <= bucket_bytes
            and not any(_nested(a, b) for a in last.members for b in spec.members)
        )
        if joins and last is not None:
            merged[-1] = UnitSpec(last.members + spec.members, last.params + spec.params)
            open_bytes += size
        else:
            merged.append(spec)
            open_bytes, open_dtype = (size, dtype) if small else (0, None)
    return merged
