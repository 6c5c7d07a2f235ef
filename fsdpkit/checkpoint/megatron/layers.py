"""Megatron's stored keys as the model's own names (pure): a stacked key `decoder.layers.X` of
shape [L, ...] is L tensors `decoder.layers.{i}.X`, each a range of it; per-layer keys (MoE and
non-uniform models) and every other key stay as stored. Optimizer state keys start `optimizer.`."""

from __future__ import annotations

from ..core.bytecopy import SourceTensor
from .joined import layer_of

STACKED_PREFIXES = ("decoder.layers.", "mtp.layers.")
OPTIMIZER_PREFIX = "optimizer."


def is_stacked(key: str) -> bool:
    prefix = next((p for p in STACKED_PREFIXES if key.startswith(p)), None)
    return prefix is not None and not key[len(prefix) :].split(".", 1)[0].isdigit()


def stacked_layers(tensors: dict[str, SourceTensor]) -> int | None:
    """The layers the stacked `decoder.layers.` keys hold (their dimension 0), None without any."""
    counts = {t.shape[0] for key, t in tensors.items() if key.startswith("decoder.layers.") and is_stacked(key) and t.shape}
    return max(counts) if counts else None


def unstacked(tensors: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """Model tensors by the model's names: stacked keys split into their layers, in layer order."""
    out: dict[str, SourceTensor] = {}
    per_layer: dict[int, dict[str, SourceTensor]] = {}
    for key, tensor in tensors.items():
        if not is_stacked(key) or not tensor.shape:
            out[key] = tensor
            continue
        prefix = next(p for p in STACKED_PREFIXES if key.startswith(p))
        rest = key[len(prefix) :]
        for layer in range(tensor.shape[0]):
            name = f"{prefix}{layer}.{rest}"
            per_layer.setdefault(layer, {})[name] = layer_of(tensor, layer, name)
    for layer in sorted(per_layer):
        out.update(per_layer[layer])
    return out
