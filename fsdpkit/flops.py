"""Forward and backward FLOPs of each unit, counted by torch's FLOP counter on the meta-device
model (nothing allocated; matrix products and attention; elementwise work is not counted)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from .engine.plan import UnitPlan
from .models.source import ModelSource


def _per_module(source: ModelSource, model: nn.Module, shape: tuple[int, int], *, backward: bool) -> dict[str, int]:
    # Fake token ids: code that would read a value (transformers' mask checks) sees a trace and skips it.
    with FakeTensorMode(allow_non_fake_inputs=True), FlopCounterMode(display=False) as counter:
        tokens = torch.zeros(shape, dtype=torch.long, device="meta")
        logits = source.logits(model, tokens[:, :-1])
        if backward:
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    prefix = type(model).__name__
    counts = {}
    for name, by_op in counter.get_flop_counts().items():
        if name == "Global":
            counts[""] = sum(by_op.values())
        elif name.startswith(prefix + "."):
            counts[name[len(prefix) + 1 :]] = sum(by_op.values())
    return counts


def _exclusive(plans: Sequence[UnitPlan], counts: dict[str, int]) -> list[int]:
    """Each unit's FLOPs less those of the units nested in it (the root: the whole model)."""
    inclusive = [sum(counts.get(member, 0) for member in plan.members) for plan in plans]

    def parent(index: int) -> int | None:
        best, length = None, -1
        for other, plan in enumerate(plans):
            for member in plan.members:
                for own in plans[index].members:
                    nested = member == "" or own.startswith(member + ".")
                    if other != index and nested and len(member) > length:
                        best, length = other, len(member)
        return best

    exclusive = list(inclusive)
    for index in range(len(plans)):
        above = parent(index)
        if above is not None:
            exclusive[above] -= inclusive[index]
    return exclusive


def unit_flops(source: ModelSource, model: nn.Module, plans: Sequence[UnitPlan], batch: int, seq_len: int) -> list[tuple[int, int]]:
    """(forward, backward) FLOPs of each unit for `batch` sequences of `seq_len` tokens, on
    `model` built on the meta device."""
    forward = _exclusive(plans, _per_module(source, model, (batch, seq_len + 1), backward=False))
    total = _exclusive(plans, _per_module(source, model, (batch, seq_len + 1), backward=True))
    return [(f, t - f) for f, t in zip(forward, total, strict=True)]
