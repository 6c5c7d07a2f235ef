"""A transformers Llama or Qwen2 model as Megatron's `torch_dist` keys (pure range arithmetic):
each layer part stacked over the layers ([L, ...]), q, k and v fused per query group
([q x (heads / groups), k, v] x groups), gate and up fused into fc1 ([all gate; all up]), and the
`_extra_state` keys of every linear layer that Megatron's loader asks for."""

from __future__ import annotations

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from .hf import FC1, FC2, PROJ, QKV
from .joined import JoinedSource, Part, rows
from .shape import ModelShape

EXTRA_STATE_PARTS = (PROJ, QKV, FC1, FC2)


class HfTensors:
    def __init__(self, tensors: dict[str, SourceTensor], where: str):
        self.tensors, self.where = tensors, where

    def get(self, name: str) -> SourceTensor:
        found = self.tensors.get(name)
        if found is None:
            raise DataCheckError(f"{self.where}: no tensor {name} (a Llama or Qwen2 model's)")
        return found


def _whole(source: SourceTensor) -> list[Part]:
    return [(source, rows(source, 0, source.shape[0]))]


def _qkv_parts(hf: HfTensors, layer: int, shape: ModelShape, kind: str) -> list[Part]:
    assert shape.heads and shape.query_groups and shape.head_dim
    per_group, head = shape.heads // shape.query_groups, shape.head_dim
    q, k, v = (hf.get(f"model.layers.{layer}.self_attn.{x}_proj.{kind}") for x in "qkv")
    parts: list[Part] = []
    for group in range(shape.query_groups):
        parts += [
            (q, rows(q, group * per_group * head, per_group * head)),
            (k, rows(k, group * head, head)),
            (v, rows(v, group * head, head)),
        ]
    return parts


def _layer_parts(hf: HfTensors, layer: int, shape: ModelShape) -> dict[str, list[Part]]:
    prefix = f"model.layers.{layer}."
    found = {
        f"{QKV}.layer_norm_weight": _whole(hf.get(prefix + "input_layernorm.weight")),
        f"{QKV}.weight": _qkv_parts(hf, layer, shape, "weight"),
        f"{PROJ}.weight": _whole(hf.get(prefix + "self_attn.o_proj.weight")),
        f"{FC1}.layer_norm_weight": _whole(hf.get(prefix + "post_attention_layernorm.weight")),
        f"{FC1}.weight": _whole(hf.get(prefix + "mlp.gate_proj.weight")) + _whole(hf.get(prefix + "mlp.up_proj.weight")),
        f"{FC2}.weight": _whole(hf.get(prefix + "mlp.down_proj.weight")),
    }
    if shape.qkv_bias:
        found[f"{QKV}.bias"] = _qkv_parts(hf, layer, shape, "bias")
    return found


def megatron_tensors(tensors: dict[str, SourceTensor], shape: ModelShape, where: str) -> list[SourceTensor]:
    """Megatron's stored tensors of a Llama or Qwen2 model given under transformers' names."""
    if shape.linear_bias:
        raise DataCheckError(f"{where}: biases on every linear layer: --to megatron writes Llama and Qwen2 models")
    hf = HfTensors(tensors, where)
    assert shape.layers
    per_layer = [_layer_parts(hf, layer, shape) for layer in range(shape.layers)]
    out: list[SourceTensor] = [_stacked("embedding.word_embeddings.weight", _whole(hf.get("model.embed_tokens.weight")), 1)]
    for part in per_layer[0]:
        parts = [p for layer in per_layer for p in layer[part]]
        out.append(_stacked(f"decoder.layers.{part}", parts, shape.layers))
    out.append(_stacked("decoder.final_layernorm.weight", _whole(hf.get("model.norm.weight")), 1))
    if "lm_head.weight" in tensors and not shape.tied:
        out.append(_stacked("output_layer.weight", _whole(hf.get("lm_head.weight")), 1))
    return out


def _stacked(key: str, parts: list[Part], layers: int) -> JoinedSource:
    """`parts` laid end to end as one tensor: `layers` equal layers ([L, ...]), or one tensor (layers 1, unstacked)."""
    first = parts[0][0]
    size = sum(r.size for _, r in parts)
    row = 1 if len(first.shape) == 1 else first.shape[1]
    inner = (size // layers,) if len(first.shape) == 1 else (size // layers // row, row)
    return JoinedSource(key, (layers, *inner) if key.startswith("decoder.layers.") else inner, parts)


def extra_state_keys(layers: int) -> list[str]:
    """The `_extra_state` objects of every stacked linear layer, as Megatron's loader names them."""
    return [f"decoder.layers.{part}._extra_state/shard_{layer}_{layers}" for layer in range(layers) for part in EXTRA_STATE_PARTS]
