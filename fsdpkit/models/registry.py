"""Built-in models by name, and objects named `package.module:attr` (model factories, --wrap classes).

Every model, built-in or not, is resolved into a model source (fsdpkit/models/source.py),
which imports this module; this module imports nothing of models/ but the GPT config.

Each built-in model has a default peak learning rate: the GPT-2 sizes take the GPT-3 paper's
(Brown et al. 2020, table 2.1: 125M 6e-4, 350M 3e-4, 760M 2.5e-4, 1.3B 2e-4), which train them
where 3e-3 diverges; gpt-tiny 3e-3; gpt-small 1e-3: in the README's bf16 tour (200 steps on
bytes) 3e-3 spiked from 3.7 to 10.8 as its warm-up ended and 6e-4 to 7.5; 1e-3 bumped to 4.7
once, and with --max-grad-norm 1 (as the tour runs) falls without a spike, to 2.3 (3e-3: 3.1).

The GPT-2 sizes also warm up over a fixed 10 steps by default: Adam's first updates move every
weight by about the learning rate whatever its gradient, and 10 steps ramp them in while the
default 20-step run still spends half its steps at the peak. A fixed count, not a fraction of
--steps, keeps a run resumed to more steps on the schedule of one run straight through; a long
run sets its own (GPT-3 warmed up over 375M tokens). The small built-ins start at their peak.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import UsageError
from .gpt_config import GPTConfig

if TYPE_CHECKING:  # torch is imported when a model is built: the names are known without it
    pass

GPT2_WARMUP_STEPS = 10


@dataclass(frozen=True)
class BuiltinModel:
    shape: GPTConfig
    peak_lr: float  # the default --lr
    warmup_steps: int = 0  # the default --warmup-steps


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "gpt-tiny": BuiltinModel(GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64), peak_lr=3e-3),
    "gpt-small": BuiltinModel(GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256), peak_lr=1e-3),
    "gpt2": BuiltinModel(GPTConfig(n_layer=12, n_head=12, n_embd=768), peak_lr=6e-4, warmup_steps=GPT2_WARMUP_STEPS),
    "gpt2-medium": BuiltinModel(GPTConfig(n_layer=24, n_head=16, n_embd=1024), peak_lr=3e-4, warmup_steps=GPT2_WARMUP_STEPS),
    "gpt2-large": BuiltinModel(GPTConfig(n_layer=36, n_head=20, n_embd=1280), peak_lr=2.5e-4, warmup_steps=GPT2_WARMUP_STEPS),
    "gpt2-xl": BuiltinModel(GPTConfig(n_layer=48, n_head=25, n_embd=1600), peak_lr=2e-4, warmup_steps=GPT2_WARMUP_STEPS),
}
GPT_CONFIGS: dict[str, GPTConfig] = {name: entry.shape for name, entry in BUILTIN_MODELS.items()}
OTHER_MODELS_LR = 3e-3  # hf: and module:factory models (no warm-up by default)
DEFAULT_MODEL = "gpt-tiny"
MODEL_HELP = (
    "gpt-tiny, gpt-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; hf:PRESET (gpt2-tiny, llama-tiny, "
    "qwen2-tiny, llama-bench) or hf:DIR (a transformers config.json, optional safetensors weights and "
    "tokenizer; needs the [hf] extra); or package.module:factory (a zero-argument function returning "
    "the nn.Module)."
)


def is_builtin(name: str) -> bool:
    return name in GPT_CONFIGS


def default_lr(name: str) -> float:
    """The peak learning rate a run of model `name` takes when --lr is not given."""
    entry = BUILTIN_MODELS.get(name)
    return entry.peak_lr if entry is not None else OTHER_MODELS_LR


def default_warmup_steps(name: str) -> int:
    """The warm-up steps a run of model `name` takes when --warmup-steps is not given."""
    entry = BUILTIN_MODELS.get(name)
    return entry.warmup_steps if entry is not None else 0


def load_object(spec: str, *, what: str) -> object:
    """Import `package.module:attr`, looking in the current directory too (as `python -m` does)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"{what} {spec!r} is neither a built-in model ({', '.join(GPT_CONFIGS)}), hf:PRESET|DIR, nor of the form package.module:name"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import error inside the user's module is the user's to see
        raise UsageError(f"cannot import {what} module {module_name!r}: {type(error).__name__}: {error}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UsageError(f"module {module_name!r} has no attribute {attr!r} ({what} {spec!r})") from None
