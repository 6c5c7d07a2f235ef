"""Resolving the model, its vocabulary and its wrap policy from a TrainConfig."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine.plan import WrapPolicy
from ..models.units import default_policy_for_model
from ..errors import UsageError
from ..models.registry import build_model, is_builtin, load_object


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    block_size: int | None
    num_params: int


def wrap_policy(model_name: str, wrap: tuple[str, ...], *, min_params: int | None = None, every: int = 1) -> WrapPolicy:
    if not wrap:
        base = default_policy_for_model(model_name)
        if min_params is not None and not base.module_classes:
            return WrapPolicy(min_params=min_params, every=every)
        return WrapPolicy(module_classes=base.module_classes, min_params=min_params, every=every)
    classes = []
    for spec in wrap:
        cls = load_object(spec, what="--wrap class")
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise UsageError(f"--wrap {spec!r} is not an nn.Module class")
        classes.append(cls)
    return WrapPolicy(module_classes=tuple(classes), min_params=min_params, every=every)


def inspect_model(model_name: str, vocab_size: int | None, wrap: tuple[str, ...], *, min_params: int | None = None, every: int = 1) -> ModelInfo:
    """Build the model on the meta device (nothing allocated) and check what training needs."""
    try:
        model = build_model(model_name, device="meta")
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(f"model factory {model_name!r} failed: {type(error).__name__}: {error}") from None
    wrap_policy(model_name, wrap, min_params=min_params, every=every)
    vocab = vocab_size if vocab_size is not None else getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"model {model_name!r} has no integer vocab_size attribute; pass --vocab-size")
    config = getattr(model, "config", None)
    block_size = getattr(config, "block_size", None)
    return ModelInfo(vocab, block_size, sum(p.numel() for p in model.parameters()))


def build_for_training(model_name: str, seed: int, *, deferred: bool | None) -> nn.Module:
    """The same initial weights on every rank and at every world size. Deferred: built on
    the meta device and materialised unit by unit by fsdpkit.shard (default for built-in
    models, whose initialisation is the same either way)."""
    torch.manual_seed(seed)
    if deferred is None:
        deferred = is_builtin(model_name)
    return build_model(model_name, device="meta" if deferred else "cpu")
