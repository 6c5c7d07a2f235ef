"""Resolving the model, its vocabulary and its wrap policy from the model section of a config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine.plan import WrapPolicy
from ..models.units import default_policy_for_model
from ..errors import UsageError
from ..models.registry import build_model, is_builtin, load_object
from .config import ModelConfig


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    block_size: int | None
    num_params: int


def wrap_policy(config: ModelConfig) -> WrapPolicy:
    if not config.wrap:
        base = default_policy_for_model(config.name)
        if config.wrap_min_params is not None and not base.module_classes:
            return WrapPolicy(min_params=config.wrap_min_params, every=config.wrap_every)
        return WrapPolicy(module_classes=base.module_classes, min_params=config.wrap_min_params, every=config.wrap_every)
    classes = []
    for spec in config.wrap:
        cls = load_object(spec, what="--wrap class")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise UsageError(f"--wrap {spec!r} is not an nn.Module class")
        classes.append(cls)
    return WrapPolicy(module_classes=tuple(classes), min_params=config.wrap_min_params, every=config.wrap_every)


def inspect_model(config: ModelConfig) -> ModelInfo:
    """Build the model on the meta device (nothing allocated) and check what training needs,
    including that every --wrap class occurs in it."""
    try:
        model = build_model(config.name, device="meta")
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(f"model factory {config.name!r} failed: {type(error).__name__}: {error}") from None
    policy = wrap_policy(config)
    present = {type(module) for module in model.modules()}
    for spec, cls in zip(config.wrap, policy.module_classes):
        if not any(issubclass(kind, cls) for kind in present):
            names = ", ".join(sorted({kind.__name__ for kind in present}))
            raise UsageError(f"--wrap {spec!r} matches no module of model {config.name!r} (its module classes: {names})")
    vocab = config.vocab_size if config.vocab_size is not None else getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"model {config.name!r} has no integer vocab_size attribute; pass --vocab-size")
    block_size = getattr(getattr(model, "config", None), "block_size", None)
    return ModelInfo(vocab, block_size, sum(p.numel() for p in model.parameters()))


def build_for_training(config: ModelConfig, seed: int) -> nn.Module:
    """The same initial weights on every rank and at every world size. Deferred: built on
    the meta device and materialised unit by unit by fsdpkit.shard (default for built-in
    models, whose initialisation is the same either way)."""
    torch.manual_seed(seed)
    deferred = is_builtin(config.name) if config.deferred_init is None else config.deferred_init
    return build_model(config.name, device="meta" if deferred else "cpu")
