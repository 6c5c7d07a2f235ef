"""A model's units: its default wrap policy, the policy a run's wrap options give, the flat-parameter unit plan that policy gives
(built on the meta device), and that plan as a checkpoint placement (`convert --model`)."""

from __future__ import annotations

from typing import Protocol

import torch.nn as nn

from ..engine.wrapping import WrapPolicy, split_units
from ..errors import UsageError
from .registry import load_object
from .source import ModelSource, resolve


class WrapOptions(Protocol):
    """A run's choice of units (`--wrap`, `--wrap-min-params`, `--wrap-every`)."""

    @property
    def wrap(self) -> tuple[str, ...]: ...
    @property
    def wrap_min_params(self) -> int | None: ...
    @property
    def wrap_every(self) -> int: ...


def default_policy(source: ModelSource, model: nn.Module) -> WrapPolicy:
    """Units of the classes the source names (built-in GPT blocks, a transformers model's
    decoder layers), else each element of every nn.ModuleList."""
    classes = source.unit_classes(model)
    return WrapPolicy(module_classes=classes) if classes else WrapPolicy()


def wrap_policy(options: WrapOptions, source: ModelSource, model: nn.Module) -> WrapPolicy:
    """--wrap classes, else the source's unit classes; with --wrap-min-params / --wrap-every."""
    if not options.wrap:
        base = default_policy(source, model)
        if options.wrap_min_params is not None and not base.module_classes:
            return WrapPolicy(min_params=options.wrap_min_params, every=options.wrap_every)
        return WrapPolicy(module_classes=base.module_classes, min_params=options.wrap_min_params, every=options.wrap_every)
    classes = []
    for spec in options.wrap:
        cls = load_object(spec, what="--wrap class")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise UsageError(f"--wrap {spec!r} is not an nn.Module class")
        classes.append(cls)
    return WrapPolicy(module_classes=tuple(classes), min_params=options.wrap_min_params, every=options.wrap_every)


def default_policy_for_model(name: str) -> WrapPolicy:
    source = resolve(name)
    return default_policy(source, source.build(device="meta"))


def unit_specs_for_model(name: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The flat-parameter plan of a model by name under its default wrap policy: a list of
    units, each an ordered list of (parameter name, shape). Lay a unit out for a sharding
    factor with `FlatLayout.from_shapes(unit, factor)`."""
    source = resolve(name)
    model = source.build(device="meta")
    return [[(p.name, p.shape) for p in unit.params] for unit in split_units(model, default_policy(source, model))]


def describe_model(name: str) -> dict:
    """What the offline commands need to know of model `name`, as JSON, from one build on the
    meta device: its flat-parameter units [[[name, shape], ...], ...], its tied parameters
    {other name: canonical name} (the first in named_parameters order, as the engine and
    checkpoints name them) and its export recipe (or None)."""
    source = resolve(name)
    model = source.build(device="meta")
    units = [[[p.name, list(p.shape)] for p in unit.params] for unit in split_units(model, default_policy(source, model))]
    canonical = {id(p): n for n, p in model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if canonical[id(p)] != n}
    return {"units": units, "aliases": aliases, "export": None if source.export is None else source.export.to_json()}


def placement_for_model(name: str):
    """The checkpoint placement that lays tensors out as the engine shards model `name` with
    one unit per wrapped module (`--bucket-bytes 0`); checkpoints load under any bucket setting."""
    from ..checkpoint.format.placement import Placement

    return Placement.flat(unit_specs_for_model(name))


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
