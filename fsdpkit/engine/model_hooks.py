"""What fsdpkit asks of a model beyond being an `nn.Module`, declared in one place.

A model declares `ModelHooks` with a method `fsdpkit_hooks(self) -> ModelHooks` (the
`DeclaresHooks` protocol), or the model source that builds it attaches them
(`declare_hooks`). Every hook is optional:

- `init_parameter(name, tensor)`: fill parameter `name` (full size, master dtype) with its
  initial values. Deferred init (a model built on the meta device) calls it instead of each
  module's `reset_parameters()`, so the values do not depend on how the model is sharded.
- `keep_dtype_buffers`: full names of floating buffers that keep their dtype under mixed
  precision: constants the model computes with in fp32 itself, such as rotary frequencies,
  which 16 bits would round (a bf16 inv_freq misplaces position 1000 by up to 2 radians).
- `export`: how `convert --to full` hands the model to transformers
  (`fsdpkit.checkpoint.core.export.HfExport`); a checkpoint records it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

HOOKS_ATTR = "fsdpkit_hooks"


@dataclass(frozen=True)
class ModelHooks:
    init_parameter: Callable[[str, Any], None] | None = None  # (name, torch.Tensor)
    keep_dtype_buffers: frozenset[str] = frozenset()
    export: Any = None  # fsdpkit.checkpoint.core.export.HfExport


@runtime_checkable
class DeclaresHooks(Protocol):
    def fsdpkit_hooks(self) -> ModelHooks: ...


def hooks_of(model: Any) -> ModelHooks:
    """The hooks `model` declares (none: `ModelHooks()`)."""
    declared = model.__dict__.get(HOOKS_ATTR)
    if declared is None and isinstance(model, DeclaresHooks):
        declared = model.fsdpkit_hooks()
    return declared if isinstance(declared, ModelHooks) else ModelHooks()


def declare_hooks(model: Any, hooks: ModelHooks) -> None:
    """Attach `hooks` to this model instance (they replace what its class declares)."""
    model.__dict__[HOOKS_ATTR] = hooks
