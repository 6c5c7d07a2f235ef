"""A model's units: its default wrap policy, the flat-parameter unit plan that policy gives
(built on the meta device), and that plan as a checkpoint placement (`convert --model`)."""

from __future__ import annotations

import torch.nn as nn

from ..engine.wrapping import WrapPolicy, plan_units
from .source import ModelSource, resolve


def default_policy(source: ModelSource, model: nn.Module) -> WrapPolicy:
    """Units of the classes the source names (built-in GPT blocks, a transformers model's
    decoder layers), else each element of every nn.ModuleList."""
    classes = source.unit_classes(model)
    return WrapPolicy(module_classes=classes) if classes else WrapPolicy()


def default_policy_for_model(name: str) -> WrapPolicy:
    source = resolve(name)
    return default_policy(source, source.build(device="meta"))


def unit_plan_for_model(name: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The flat-parameter plan of a model by name under its default wrap policy: a list of
    units, each an ordered list of (parameter name, shape). Lay a unit out for a sharding
    factor with `FlatLayout.from_shapes(unit, factor)`."""
    source = resolve(name)
    model = source.build(device="meta")
    return [[(p.name, p.shape) for p in unit.params] for unit in plan_units(model, default_policy(source, model))]


def describe_model(name: str) -> dict:
    """What the offline commands need to know of model `name`, as JSON, from one build on the
    meta device: its flat-parameter units [[[name, shape], ...], ...], its tied parameters
    {other name: canonical name} (the first in named_parameters order, as the engine and
    checkpoints name them) and its export recipe (or None)."""
    source = resolve(name)
    model = source.build(device="meta")
    units = [[[p.name, list(p.shape)] for p in unit.params] for unit in plan_units(model, default_policy(source, model))]
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}
    return {"units": units, "aliases": aliases, "export": None if source.export is None else source.export.to_json()}


def placement_for_model(name: str):
    """The checkpoint placement that lays tensors out as the engine shards model `name` with
    one unit per wrapped module (`--bucket-bytes 0`); checkpoints load under any bucket setting."""
    from ..checkpoint.format.placement import Placement

    return Placement.flat(unit_plan_for_model(name))


def main() -> None:
    """`python -m fsdpkit.models.units NAME`: describe_model(NAME) on stdout; a usage error is
    one line on stderr and exit 2."""
    import json
    import sys

    from ..errors import UsageError

    try:
        print(json.dumps(describe_model(sys.argv[1])))
    except UsageError as error:
        print(error, file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
