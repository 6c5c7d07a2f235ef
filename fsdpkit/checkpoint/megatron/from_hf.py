"""A transformers Llama, Qwen2 or GPT-2 model as Megatron's `torch_dist` keys (pure range
arithmetic): each layer part stacked over the layers ([L, ...]), q, k and v fused per query group
([q x (heads / groups), k, v] x groups; GPT-2's c_attn holds [all q; all k; all v]), gate and up
fused into fc1 ([all gate; all up]), and the `_extra_state` keys of every linear layer that
Megatron's loader asks for. GPT-2's Conv1D weights are taken in Linear orientation (out, in):
the caller transposes those stored the other way."""

from __future__ import annotations

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from .hf import FC1, FC2, PROJ, QKV
from .joined import JoinedSource, Part, rows
from .shape import LAYERNORM, ModelShape

EXTRA_STATE_PARTS = (PROJ, QKV, FC1, FC2)
GPT2_PREFIX = "transformer."  # GPT2LMHeadModel's; a GPT2Model's (and old GPT-2 files') names lack it


class HfTensors:
    def __init__(self, tensors: dict[str, SourceTensor], where: str):
        self.tensors, self.where = tensors, where

    def get(self, name: str) -> SourceTensor:
        found = self.tensors.get(name, self.tensors.get(name.removeprefix(GPT2_PREFIX)))
        if found is None:
            raise DataCheckError(f"{self.where}: no tensor {name} (a Llama, Qwen2 or GPT-2 model's)")
        return found


def _whole(source: SourceTensor) -> list[Part]:
    return [(source, rows(source, 0, source.shape[0]))]


def _qkv_parts(starts: dict[str, tuple[SourceTensor, int]], shape: ModelShape) -> list[Part]:
    """Megatron's fused QKV rows, group by group, from q, k and v given as (tensor, first row)."""
    assert shape.heads and shape.query_groups and shape.head_dim
    per_group, head = shape.heads // shape.query_groups, shape.head_dim
    (q, q0), (k, k0), (v, v0) = starts["q"], starts["k"], starts["v"]
    parts: list[Part] = []
    for group in range(shape.query_groups):
        parts += [
            (q, rows(q, q0 + group * per_group * head, per_group * head)),
            (k, rows(k, k0 + group * head, head)),
            (v, rows(v, v0 + group * head, head)),
        ]
    return parts


def _split_qkv(hf: HfTensors, layer: int, kind: str) -> dict[str, tuple[SourceTensor, int]]:
    return {x: (hf.get(f"model.layers.{layer}.self_attn.{x}_proj.{kind}"), 0) for x in "qkv"}


def _fused_qkv(hf: HfTensors, layer: int, kind: str, shape: ModelShape) -> dict[str, tuple[SourceTensor, int]]:
    assert shape.heads and shape.head_dim
    fused, size = hf.get(f"{GPT2_PREFIX}h.{layer}.attn.c_attn.{kind}"), shape.heads * shape.head_dim
    if fused.shape[0] != 3 * size:
        raise DataCheckError(f"{hf.where}: {fused.name} has {fused.shape[0]} rows (out features); q, k and v of {size} need {3 * size}")
    return {"q": (fused, 0), "k": (fused, size), "v": (fused, 2 * size)}


def _layer_parts(hf: HfTensors, layer: int, shape: ModelShape) -> dict[str, list[Part]]:
    prefix = f"model.layers.{layer}."
    found = {
        f"{QKV}.layer_norm_weight": _whole(hf.get(prefix + "input_layernorm.weight")),
        f"{QKV}.weight": _qkv_parts(_split_qkv(hf, layer, "weight"), shape),
        f"{PROJ}.weight": _whole(hf.get(prefix + "self_attn.o_proj.weight")),
        f"{FC1}.layer_norm_weight": _whole(hf.get(prefix + "post_attention_layernorm.weight")),
        f"{FC1}.weight": _whole(hf.get(prefix + "mlp.gate_proj.weight")) + _whole(hf.get(prefix + "mlp.up_proj.weight")),
        f"{FC2}.weight": _whole(hf.get(prefix + "mlp.down_proj.weight")),
    }
    if shape.qkv_bias:
        found[f"{QKV}.bias"] = _qkv_parts(_split_qkv(hf, layer, "bias"), shape)
    return found


def _gpt2_layer_parts(hf: HfTensors, layer: int, shape: ModelShape) -> dict[str, list[Part]]:
    prefix = f"{GPT2_PREFIX}h.{layer}."
    found = {f"{QKV}.layer_norm_{kind}": _whole(hf.get(f"{prefix}ln_1.{kind}")) for kind in ("weight", "bias")}
    for kind in ("weight", "bias"):
        found[f"{QKV}.{kind}"] = _qkv_parts(_fused_qkv(hf, layer, kind, shape), shape)
    for part, name in ((PROJ, "attn.c_proj"), (f"{FC1}.layer_norm", "ln_2"), (FC1, "mlp.c_fc"), (FC2, "mlp.c_proj")):
        for kind in ("weight", "bias"):
            found[f"{part}_{kind}" if part.endswith("layer_norm") else f"{part}.{kind}"] = _whole(hf.get(f"{prefix}{name}.{kind}"))
    return found


def embedding_name(shape: ModelShape) -> str:
    return f"{GPT2_PREFIX}wte.weight" if shape.norm == LAYERNORM else "model.embed_tokens.weight"


def megatron_tensors(tensors: dict[str, SourceTensor], shape: ModelShape, where: str) -> list[SourceTensor]:
    """Megatron's stored tensors of a Llama, Qwen2 or GPT-2 model given under transformers' names."""
    gpt2 = shape.norm == LAYERNORM
    if shape.linear_bias and not gpt2:
        raise DataCheckError(f"{where}: RMSNorm with biases on every linear layer: --to megatron writes Llama, Qwen2 and GPT-2 models")
    hf = HfTensors(tensors, where)
    assert shape.layers
    layer_parts = _gpt2_layer_parts if gpt2 else _layer_parts
    per_layer = [layer_parts(hf, layer, shape) for layer in range(shape.layers)]
    out: list[SourceTensor] = [_stacked("embedding.word_embeddings.weight", _whole(hf.get(embedding_name(shape))), 1)]
    if gpt2:
        out.append(_stacked("embedding.position_embeddings.weight", _whole(hf.get(f"{GPT2_PREFIX}wpe.weight")), 1))
    for part in per_layer[0]:
        parts = [p for layer in per_layer for p in layer[part]]
        out.append(_stacked(f"decoder.layers.{part}", parts, shape.layers))
    norms = [("weight", f"{GPT2_PREFIX}ln_f.weight"), ("bias", f"{GPT2_PREFIX}ln_f.bias")] if gpt2 else [("weight", "model.norm.weight")]
    out += [_stacked(f"decoder.final_layernorm.{kind}", _whole(hf.get(name)), 1) for kind, name in norms]
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
