"""Where a model comes from, and what fsdpkit needs to know about it.

    resolve("gpt-tiny")               # a built-in GPT (fsdpkit/models/gpt.py)
    resolve("my_pkg.models:build")    # a zero-argument factory returning an nn.Module
    resolve("hf:llama-tiny")          # transformers: a preset, or hf:PATH (config.json [+ weights, tokenizer])

Each is a `ModelSource`: how to build the nn.Module (on the meta device nothing is
allocated; the model's own `init_parameter(name, tensor)`, when it has one, initialises it
later, one unit at a time), its default unit classes, its logits, its vocabulary and sequence
limits, the weights and tokenizer it comes with, and what an export writes next to its
weights. Train, plan, convert and --init-from use only this interface.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..checkpoint.core.export import HfExport
from ..engine.model_hooks import declare_hooks, hooks_of
from ..errors import UsageError
from . import hf
from .gpt import GPT, Block
from .gpt_export import gpt2_export
from .registry import GPT_CONFIGS, load_object


def call_model(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a model called on token ids: its output, or the output's `.logits`."""
    output = model(ids)
    return output if isinstance(output, torch.Tensor) else output.logits


def no_unit_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    return ()  # the wrap policy's ModuleList rule: each element of every nn.ModuleList


class InitSkippedOnMeta(TorchFunctionMode):
    """Initialisers (`torch.nn.init.*`, `Tensor.normal_` and the like) do nothing to meta
    tensors: there are no values to set, and torch runs them on meta through its Python
    decompositions, which import torch._dynamo (a large import that slows start-up)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            target = args[0] if args else kwargs.get("tensor")  # nn.init passes it by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


_INITIALISERS = frozenset(
    [getattr(nn.init, name) for name in nn.init.__all__ if name.endswith("_")]
    + [getattr(torch.Tensor, name) for name in ("normal_", "uniform_", "fill_", "zero_", "random_", "exponential_")]
)


@dataclass(frozen=True)
class ModelSource:
    spec: str
    make: Callable[[torch.device | str, int | None], nn.Module]  # (device, seed or None: as seeded) -> the model
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = call_model
    unit_classes: Callable[[nn.Module], tuple[type[nn.Module], ...]] = no_unit_classes
    vocab_size: int | None = None  # None: the built model's `vocab_size` attribute
    max_seq_len: int | None = None
    deferred_init: bool = False  # build on the meta device by default (initialisation reproduces eager)
    weights: Path | None = None  # a full checkpoint the model comes with, loaded unless --init-from/--resume
    tokenizer: str | None = None  # hf:DIR when the model comes with a tokenizer (fsdpkit.data.tokens.load_tokenizer)
    export: HfExport | None = None  # what `convert --to full` writes for transformers

    def build(self, *, device: torch.device | str = "cpu", seed: int | None = None) -> nn.Module:
        """The model on `device` ("meta": nothing real), initialised from `seed` (default: the
        torch seed already set). The export recipe goes with it (the checkpoint records it)."""
        if torch.device(device).type == "meta":
            with InitSkippedOnMeta():
                model = self.make(device, seed)
        else:
            model = self.make(device, seed)
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory {self.spec!r} returned {type(model).__name__}, not an nn.Module")
        if self.export is not None:
            declare_hooks(model, dataclasses.replace(hooks_of(model), export=self.export))
        return model


def resolve(spec: str) -> ModelSource:
    """The model source `spec` names (validated now; nothing is built)."""
    if spec in GPT_CONFIGS:
        config = GPT_CONFIGS[spec]
        return ModelSource(
            spec,
            partial(_build_gpt, config),
            unit_classes=lambda model: (Block,),
            vocab_size=config.vocab_size,
            max_seq_len=config.block_size,
            deferred_init=True,
            export=gpt2_export(config),
        )
    if hf.is_hf_spec(spec):
        config, directory = hf.load_config(spec)
        text = config.get_text_config()
        return ModelSource(
            spec,
            partial(_build_hf, config),
            logits=hf.logits,
            unit_classes=hf.unit_classes,
            vocab_size=text.vocab_size,
            max_seq_len=getattr(text, "max_position_embeddings", None),
            deferred_init=True,
            weights=hf.weights_in(directory, spec),
            tokenizer=f"{hf.PREFIX}{directory}" if hf.has_tokenizer(directory) else None,
            export=hf.export_for(config, directory),
        )
    if spec in hf.PRESETS:
        raise UsageError(f"--model {spec!r} is not a built-in model ({', '.join(GPT_CONFIGS)}): did you mean {hf.PREFIX}{spec}?")
    factory = load_object(spec, what="model factory")
    if not callable(factory):
        raise UsageError(f"model factory {spec!r} is not callable")
    return ModelSource(spec, partial(_build_factory, spec, factory))


def _build_gpt(config, device: torch.device | str, seed: int | None) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)  # GPT draws each parameter from this seed and its name
        with torch.device(device):
            return GPT(config)


def _build_hf(config, device: torch.device | str, seed: int | None) -> nn.Module:
    return hf.build(config, device, torch.initial_seed() if seed is None else seed)


def _build_factory(spec: str, factory: Callable[[], Any], device: torch.device | str, seed: int | None) -> Any:
    if seed is not None:
        torch.manual_seed(seed)
    try:
        with torch.device(device):
            return factory()
    except UsageError:
        raise
    except Exception as error:
        raise UsageError(f"model factory {spec!r} failed: {type(error).__name__}: {error}") from None


def build_model(name: str, *, device: str | torch.device = "cpu") -> nn.Module:
    """Build a model by name on `device` (use 'meta' to build nothing real), from the torch
    seed already set: the model source's build for callers that need only the module."""
    return resolve(name).build(device=device)
