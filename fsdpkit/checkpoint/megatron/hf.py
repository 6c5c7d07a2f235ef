"""Megatron GPT models as transformers models (pure range arithmetic and names, nothing read):
Llama-style (RMSNorm, SwiGLU, RoPE) as `LlamaForCausalLM`, with a bias on QKV only as
`Qwen2ForCausalLM`, GPT-style (LayerNorm, GELU, learned positions) as `GPT2LMHeadModel`.

Megatron's fused QKV weight holds, per query group, its query heads' rows then one key head's and
one value head's: [q x (heads / groups), k, v] x groups. fc1 of a gated MLP is [all gate rows;
all up rows]. Each transformers tensor is a `JoinedSource` of those rows. GPT-2 keeps q, k and v
fused ([all q; all k; all v]) in a Conv1D, whose weights are stored transposed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import DataCheckError
from ..core.bytecopy import SourceTensor
from .joined import row_blocks
from .shape import GELU, GELU_TANH, LAYERNORM, LEARNED, RMSNORM, ROPE, SWIGLU, ModelShape

LLAMA, QWEN2, GPT2 = "LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"
GPT2_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# the model's name of each layer part, and the names a local (non Transformer Engine) spec gives the norms
QKV, PROJ, FC1, FC2 = "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"
NORM_NAMES = {
    "input_norm": (f"{QKV}.layer_norm_", "input_layernorm."),
    "mlp_norm": (f"{FC1}.layer_norm_", "pre_mlp_layernorm."),
}


@dataclass(frozen=True)
class HfModel:
    architecture: str
    tensors: list[SourceTensor]  # under transformers' names, in order
    config: dict
    transposed: tuple[str, ...]  # name suffixes of weights stored transposed


def architecture_of(shape: ModelShape, where: str) -> str:
    """The transformers class whose math is the model's; a DataCheckError naming what does not fit."""
    if shape.experts:
        raise DataCheckError(f"{where}: a mixture-of-experts model ({shape.experts} experts): no transformers layout for it here")
    key = (shape.norm, shape.activation, shape.position_embedding)
    if key == (RMSNORM, SWIGLU, ROPE):
        return QWEN2 if shape.qkv_bias and not shape.linear_bias else LLAMA
    if key in ((LAYERNORM, GELU, LEARNED), (LAYERNORM, GELU_TANH, LEARNED)) and shape.query_groups == shape.heads and shape.linear_bias:
        return GPT2
    raise DataCheckError(
        f"{where}: norm {shape.norm}, activation {shape.activation}, position embedding {shape.position_embedding},"
        f" {shape.heads} heads in {shape.query_groups} groups, biases {shape.linear_bias}: no transformers class matches"
        " (Llama: RMSNorm swiglu rope; Qwen2: and a QKV bias; GPT-2: LayerNorm gelu learned_absolute, biases, no GQA)"
    )


class LayerTensors:
    """One layer's Megatron tensors by part name, looked up under either naming."""

    def __init__(self, model: dict[str, SourceTensor], layer: int, where: str):
        self.model, self.prefix, self.where = model, f"decoder.layers.{layer}.", where

    def get(self, part: str, suffix: str, *, required: bool = True) -> SourceTensor | None:
        names = [f"{p}{suffix}" for p in NORM_NAMES[part]] if part in NORM_NAMES else [f"{part}.{suffix}"]
        for name in names:
            found = self.model.get(self.prefix + name)
            if found is not None:
                return found
        if required:
            raise DataCheckError(f"{self.where}: no tensor {self.prefix}{names[0]} (the model's shape needs it)")
        return None


def qkv_blocks(shape: ModelShape) -> dict[str, list[tuple[int, int]]]:
    """Rows (first, count) of q, k and v in a fused QKV weight, group by group."""
    assert shape.heads and shape.query_groups and shape.head_dim
    per_group = shape.heads // shape.query_groups
    stride = (per_group + 2) * shape.head_dim
    blocks: dict[str, list[tuple[int, int]]] = {"q": [], "k": [], "v": []}
    for group in range(shape.query_groups):
        base = group * stride
        blocks["q"].append((base, per_group * shape.head_dim))
        blocks["k"].append((base + per_group * shape.head_dim, shape.head_dim))
        blocks["v"].append((base + (per_group + 1) * shape.head_dim, shape.head_dim))
    return blocks


def _check_qkv(qkv: SourceTensor, shape: ModelShape, where: str) -> None:
    assert shape.heads and shape.query_groups and shape.head_dim
    expected = (shape.heads + 2 * shape.query_groups) * shape.head_dim
    if qkv.shape[0] != expected:
        raise DataCheckError(
            f"{where}: {qkv.name} has {qkv.shape[0]} rows; {shape.heads} heads in {shape.query_groups} groups of"
            f" {shape.head_dim} need {expected} (is the recorded shape this checkpoint's? name another with --model hf:DIR)"
        )


def llama_layer(layer: LayerTensors, shape: ModelShape, out: str, bias: dict[str, bool]) -> list[SourceTensor]:
    qkv = layer.get(QKV, "weight")
    assert qkv is not None and shape.ffn
    _check_qkv(qkv, shape, layer.where)
    blocks = qkv_blocks(shape)
    found: list[SourceTensor] = [renamed(layer.get("input_norm", "weight"), f"{out}.input_layernorm.weight")]
    for letter in "qkv":
        found.append(row_blocks(qkv, f"{out}.self_attn.{letter}_proj.weight", blocks[letter]))
        if bias["qkv"]:
            found.append(row_blocks(need(layer.get(QKV, "bias")), f"{out}.self_attn.{letter}_proj.bias", blocks[letter]))
    found.append(renamed(layer.get(PROJ, "weight"), f"{out}.self_attn.o_proj.weight"))
    if bias["linear"]:
        found.append(renamed(layer.get(PROJ, "bias"), f"{out}.self_attn.o_proj.bias"))
    found.append(renamed(layer.get("mlp_norm", "weight"), f"{out}.post_attention_layernorm.weight"))
    fc1 = need(layer.get(FC1, "weight"))
    found.append(row_blocks(fc1, f"{out}.mlp.gate_proj.weight", [(0, shape.ffn)]))
    found.append(row_blocks(fc1, f"{out}.mlp.up_proj.weight", [(shape.ffn, shape.ffn)]))
    if bias["linear"]:
        fc1_bias = need(layer.get(FC1, "bias"))
        found.append(row_blocks(fc1_bias, f"{out}.mlp.gate_proj.bias", [(0, shape.ffn)]))
        found.append(row_blocks(fc1_bias, f"{out}.mlp.up_proj.bias", [(shape.ffn, shape.ffn)]))
    found.append(renamed(layer.get(FC2, "weight"), f"{out}.mlp.down_proj.weight"))
    if bias["linear"]:
        found.append(renamed(layer.get(FC2, "bias"), f"{out}.mlp.down_proj.bias"))
    return found


def gpt2_layer(layer: LayerTensors, shape: ModelShape, out: str) -> list[SourceTensor]:
    qkv, qkv_bias = need(layer.get(QKV, "weight")), need(layer.get(QKV, "bias"))
    _check_qkv(qkv, shape, layer.where)
    blocks = qkv_blocks(shape)
    fused = blocks["q"] + blocks["k"] + blocks["v"]
    pairs = [
        (need(layer.get("input_norm", "weight")), "ln_1.weight"),
        (need(layer.get("input_norm", "bias")), "ln_1.bias"),
        (row_blocks(qkv, "", fused), "attn.c_attn.weight"),
        (row_blocks(qkv_bias, "", fused), "attn.c_attn.bias"),
        (need(layer.get(PROJ, "weight")), "attn.c_proj.weight"),
        (need(layer.get(PROJ, "bias")), "attn.c_proj.bias"),
        (need(layer.get("mlp_norm", "weight")), "ln_2.weight"),
        (need(layer.get("mlp_norm", "bias")), "ln_2.bias"),
        (need(layer.get(FC1, "weight")), "mlp.c_fc.weight"),
        (need(layer.get(FC1, "bias")), "mlp.c_fc.bias"),
        (need(layer.get(FC2, "weight")), "mlp.c_proj.weight"),
        (need(layer.get(FC2, "bias")), "mlp.c_proj.bias"),
    ]
    return [renamed(source, f"{out}.{name}") for source, name in pairs]


def need(found: SourceTensor | None) -> SourceTensor:
    assert found is not None  # LayerTensors.get raised for a required one
    return found


def renamed(source: SourceTensor | None, name: str) -> SourceTensor:
    source = need(source)
    return row_blocks(source, name, [(0, source.shape[0])]) if source.shape else source


def top_tensor(model: dict[str, SourceTensor], name: str, where: str) -> SourceTensor:
    found = model.get(name)
    if found is None:
        raise DataCheckError(f"{where}: no tensor {name} (the model's shape needs it)")
    return found
