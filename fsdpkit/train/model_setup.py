"""The model of a run, from its model source: checks, wrap policy, building, starting weights."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine.model_hooks import declare_hooks, hooks_of
from ..errors import UsageError
from ..models.source import ModelSource
from ..models.units import wrap_policy
from .config import CheckpointConfig, ModelConfig


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    block_size: int | None
    num_params: int
    meta_model: nn.Module  # built on the meta device: shapes and names, nothing allocated


def inspect_model(config: ModelConfig, source: ModelSource) -> ModelInfo:
    """Build the model on the meta device (nothing allocated) and check what training needs,
    including that every --wrap class occurs in it."""
    model = source.build(device="meta", seed=0)
    policy = wrap_policy(config, source, model)
    present = {type(module) for module in model.modules()}
    for spec, cls in zip(config.wrap, policy.module_classes, strict=False):
        if not any(issubclass(kind, cls) for kind in present):
            names = ", ".join(sorted({kind.__name__ for kind in present}))
            raise UsageError(f"--wrap {spec!r} matches no module of model {config.name!r} (its module classes: {names})")
    vocab = config.vocab_size or source.vocab_size or getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise UsageError(f"model {config.name!r} has no integer vocab_size attribute; pass --vocab-size")
    block_size = source.max_seq_len or getattr(getattr(model, "config", None), "block_size", None)
    return ModelInfo(vocab, block_size, sum(p.numel() for p in model.parameters()), model)


def initial_weights(checkpoint: CheckpointConfig, source: ModelSource) -> str | None:
    """Where a new run's weights come from: --init-from, else the weights the model comes with
    (hf:DIR with safetensors, as from_pretrained loads them); None when resuming or random."""
    if checkpoint.resume:
        return None
    if checkpoint.init_from:
        return checkpoint.init_from
    return str(source.weights) if source.weights is not None else None


def build_for_training(config: ModelConfig, source: ModelSource, seed: int, *, weights_follow: bool) -> nn.Module:
    """The same initial weights on every rank and at every world size. Deferred (the default
    for sources whose initialisation is the same either way): built on the meta device and
    materialised unit by unit by fsdpkit.shard. With `weights_follow` (a checkpoint will
    overwrite every parameter) a deferred model's parameters are not drawn at all."""
    torch.manual_seed(seed)  # the same random stream on every rank (dropout), kept in checkpoints
    deferred = source.deferred_init if config.deferred_init is None else config.deferred_init
    model = source.build(device="meta" if deferred else "cpu", seed=seed)
    hooks = hooks_of(model)
    if deferred and weights_follow and hooks.init_parameter is not None:
        declare_hooks(model, dataclasses.replace(hooks, init_parameter=_left_for_the_checkpoint))
    return model


def _left_for_the_checkpoint(name: str, tensor) -> None:
    tensor.zero_()
