"""What a training run chooses beside its model and sharding, read by the trainer and the
planner alike: the optimizer, and mixed precision by name (`--mixed-precision`,
`--reduce-dtype`) rather than as a MixedPrecision of torch dtypes."""

from __future__ import annotations

import enum

from ..dtypes import SHORT_NAMES, of_torch
from ..engine.config import MixedPrecision
from ..errors import UsageError


class Optimizer(enum.StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


PRECISIONS = ("none", "bf16", "fp16")
REDUCE_DTYPES = SHORT_NAMES


def precision_policy(name: str, reduce_dtype: str | None = None) -> MixedPrecision:
    if name not in PRECISIONS:
        raise UsageError(f"unknown --mixed-precision {name!r}: use one of {', '.join(PRECISIONS)}")
    if reduce_dtype is not None and reduce_dtype not in REDUCE_DTYPES:
        raise UsageError(f"unknown --reduce-dtype {reduce_dtype!r}: use one of {', '.join(REDUCE_DTYPES)}")
    return MixedPrecision.from_name(name, reduce_dtype=reduce_dtype)


def precision_names(policy: MixedPrecision) -> tuple[str, str | None]:
    """(name, reduce dtype or None when it is the name's default): the inverse of precision_policy."""
    short = of_torch(policy.param_dtype).short if policy.param_dtype is not None else None
    name = "none" if short in (None, "fp32") else short
    if policy.reduce_dtype == precision_policy(name).reduce_dtype:
        return name, None
    reduce_dtype = policy.reduce_dtype or policy.param_dtype  # None: gradients reduce in the compute dtype
    return name, of_torch(reduce_dtype).short if reduce_dtype is not None else "fp32"
