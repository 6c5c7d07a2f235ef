"""The model as the planner sees it: built on the meta device (nothing allocated), with the
engine's units (fsdpkit.engine.wrapping) under the run's wrap options and bucketing. Memory, time
and calibration all start from it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine.wrapping import UnitSpec, WrapPolicy, bucket_units, split_units
from ..errors import UsageError
from ..models.source import ModelSource, resolve
from ..models.units import WrapOptions, wrap_policy


@dataclass(frozen=True)
class MetaModel:
    source: ModelSource
    model: nn.Module  # on the meta device
    policy: WrapPolicy
    plans: tuple[UnitSpec, ...]  # the engine's units, root first, in forward order
    master_dtype: torch.dtype  # the one dtype of every parameter

    @property
    def master_bytes(self) -> int:
        return torch.empty(0, dtype=self.master_dtype).element_size()

    @property
    def num_params(self) -> int:
        return sum(param.numel() for param in self.model.parameters())


def build_meta_model(spec: str, wrap: WrapOptions, bucket_bytes: int) -> MetaModel:
    """Model `spec` on the meta device and its units under `wrap`, bucketed to `bucket_bytes`."""
    source = resolve(spec)
    model = source.build(device="meta", seed=0)
    dtypes = {param.dtype for param in model.parameters()}
    if len(dtypes) != 1:
        raise UsageError(f"model {spec!r} mixes parameter dtypes {sorted(map(str, dtypes))}; the planner needs one master dtype")
    policy = wrap_policy(wrap, source, model)
    plans = tuple(bucket_units(model, split_units(model, policy), bucket_bytes))
    return MetaModel(source, model, policy, plans, dtypes.pop())
