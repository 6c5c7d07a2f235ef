"""A named model's units: its default wrap policy, the flat-parameter unit plan that policy
gives (built on the meta device), and that plan as a checkpoint placement (`convert --model`)."""

from __future__ import annotations

from ..engine.plan import WrapPolicy, plan_units
from .registry import build_model, default_unit_classes


def default_policy_for_model(model_name: str) -> WrapPolicy:
    classes = default_unit_classes(model_name)
    return WrapPolicy(module_classes=classes) if classes else WrapPolicy()


def unit_plan_for_model(name: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The flat-parameter plan of a model by name under its default wrap policy: a list of
    units, each an ordered list of (parameter name, shape). Lay a unit out for a sharding
    factor with `FlatLayout.from_shapes(unit, factor)`."""
    model = build_model(name, device="meta")
    return [[(p.name, p.shape) for p in unit.params] for unit in plan_units(model, default_policy_for_model(name))]


def placement_for_model(name: str):
    """The checkpoint placement that lays tensors out as the engine shards model `name`."""
    from ..checkpoint.placement import Placement

    return Placement.flat(unit_plan_for_model(name))
