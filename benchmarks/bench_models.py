"""The models the engine benchmarks train, chosen by name through one function.

    gpt-tiny, gpt-small, gpt2, ...   fsdpkit's built-in GPTs (units: each Block)
    llama-small                      benchmarks/llama_style.py: a Llama-style 6-block model
    hf:PRESET|DIR                    a transformers model (units: its decoder layers)
    package.module:factory           any zero-argument factory of an nn.Module (units: the
                                     elements of every nn.ModuleList)

Every source goes through fsdpkit's model source (fsdpkit.models.source.resolve), and every
system wraps the same modules: the units fsdpkit's plan picks for the model are the ones
FSDP2 and FSDP1 wrap too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdpkit.engine.wrapping import WrapPolicy, split_units
from fsdpkit.models.source import ModelSource, resolve

LOCAL_MODELS = {
    "llama-small": "llama_style:llama_small",
    "small-params": "small_params:small_params",
    "small-units": "small_params:small_units",
}  # benchmarks/ is on sys.path


@dataclass(frozen=True)
class BenchModel:
    name: str
    source: ModelSource
    vocab_size: int
    num_params: int

    def build(self, device: torch.device | str = "cpu", *, seed: int = 0) -> nn.Module:
        return self.source.build(device=device, seed=seed)

    def wrap(self, model: nn.Module) -> WrapPolicy:
        return WrapPolicy(module_classes=self.source.unit_classes(model))

    def logits(self, model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return self.source.logits(model, tokens)

    def unit_modules(self, model: nn.Module) -> list[str]:
        """Names of the modules that form units (the root, "", excluded), in pre-order."""
        return [name for plan in split_units(model, self.wrap(model)) for name in plan.members if name]


@functools.cache
def resolve_model(name: str) -> BenchModel:
    source = resolve(LOCAL_MODELS.get(name, name))
    meta = source.build(device="meta")
    vocab = source.vocab_size or getattr(meta, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"model {name!r} has no integer vocab_size attribute (the synthetic data needs one)")
    return BenchModel(name, source, vocab, sum(p.numel() for p in meta.parameters()))
