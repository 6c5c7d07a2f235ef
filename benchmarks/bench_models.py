"""The models the engine benchmarks train, chosen by name through one function.

    gpt-tiny, gpt-small, gpt2, ...   fsdpkit's built-in GPTs (units: each Block)
    llama-small                      benchmarks/llama_style.py: a Llama-style 6-block model
    package.module:factory           any zero-argument factory of an nn.Module (units: the
                                     elements of every nn.ModuleList)

Every system wraps the same modules: the units fsdpkit's plan picks for the model are the
ones FSDP2 and FSDP1 wrap too. New sources (e.g. `hf:...`) are one more branch in
`resolve_model`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from fsdpkit.engine.plan import WrapPolicy, default_policy_for_model, plan_units
from fsdpkit.models.registry import build_model, is_builtin, model_factory

LOCAL_MODELS = {"llama-small": "llama_style:llama_small"}  # benchmarks/ is on sys.path


@dataclass(frozen=True)
class BenchModel:
    name: str
    factory: Callable[[], nn.Module]  # builds on the current default device
    wrap: WrapPolicy
    vocab_size: int
    num_params: int
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor] = lambda model, tokens: model(tokens)

    def build(self, device: torch.device | str = "cpu") -> nn.Module:
        with torch.device(device):
            return self.factory()

    def unit_modules(self, model: nn.Module) -> list[str]:
        """Names of the modules that form units (the root, "", excluded), in pre-order."""
        return [name for plan in plan_units(model, self.wrap) for name in plan.members if name]


@functools.lru_cache(maxsize=None)
def resolve_model(name: str) -> BenchModel:
    spec = LOCAL_MODELS.get(name, name)
    wrap = default_policy_for_model(spec) if is_builtin(spec) else WrapPolicy()
    meta = build_model(spec, device="meta")
    vocab = getattr(meta, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"model {name!r} has no integer vocab_size attribute (the synthetic data needs one)")
    return BenchModel(name, model_factory(spec), wrap, vocab, sum(p.numel() for p in meta.parameters()))
