"""Built-in models by name, and objects named `package.module:attr` (model factories, --wrap classes).

Every model, built-in or not, is resolved into a model source (fsdpkit/models/source.py),
which imports this module; this module imports nothing of models/ but the GPT config.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING

from ..errors import UsageError
from .gpt_config import GPTConfig

if TYPE_CHECKING:  # torch is imported when a model is built: the names are known without it
    pass

GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64),
    "gpt-small": GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256),
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}
DEFAULT_MODEL = "gpt-tiny"
MODEL_HELP = (
    "gpt-tiny, gpt-small, gpt2, gpt2-medium, gpt2-large, gpt2-xl; hf:PRESET (gpt2-tiny, llama-tiny, "
    "qwen2-tiny, llama-bench) or hf:DIR (a transformers config.json, optional safetensors weights and "
    "tokenizer; needs the [hf] extra); or package.module:factory (a zero-argument function returning "
    "the nn.Module)."
)


def is_builtin(name: str) -> bool:
    return name in GPT_CONFIGS


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
