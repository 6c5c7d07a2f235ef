"""A Megatron model's shape (no torch, pure): what its checkpoint records of it (Megatron-LM's
`args`, NeMo's `model.yaml` config, or a transformers `config.json` named with `--model hf:DIR`)
completed by what its tensors' shapes say."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ...errors import DataCheckError, UsageError

RMSNORM, LAYERNORM = "RMSNorm", "LayerNorm"
SWIGLU, GELU, GELU_TANH = "swiglu", "gelu", "gelu_tanh"  # gelu_tanh: Megatron-LM's openai_gelu, transformers' gelu_new
ROPE, LEARNED = "rope", "learned_absolute"


@dataclass(frozen=True)
class ModelShape:
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    query_groups: int | None = None
    head_dim: int | None = None
    ffn: int | None = None
    vocab: int | None = None  # padded, as the embedding holds it
    norm: str | None = None
    activation: str | None = None
    position_embedding: str | None = None
    norm_epsilon: float | None = None
    rope_theta: float | None = None
    max_positions: int | None = None
    qkv_bias: bool | None = None
    linear_bias: bool | None = None
    tied: bool | None = None
    experts: int | None = None  # MoE: the experts per layer
    recorded_by: str = ""  # where heads and query groups came from

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value not in (None, "")}

    def completed(self, other: ModelShape) -> ModelShape:
        """This shape with what it lacks taken from `other`."""
        given = {key: value for key, value in asdict(other).items() if value not in (None, "") and getattr(self, key) in (None, "")}
        return replace(self, **given)

    def missing(self, *names: str) -> list[str]:
        return [name for name in names if getattr(self, name) is None]


def _get(source: Any, *names: str) -> Any:
    for name in names:
        value = source.get(name) if isinstance(source, dict) else None
        if value is not None:
            return value
    return None


def _activation(config: dict) -> str | None:
    named = str(_get(config, "activation_func") or "")
    if _get(config, "swiglu") or (_get(config, "gated_linear_unit") and "silu" in (named or "silu")):
        return SWIGLU
    if _get(config, "openai_gelu") or "openai_gelu" in named:
        return GELU_TANH
    hf = _get(config, "hidden_act", "activation_function")
    if hf in ("silu", "swish"):
        return SWIGLU
    if config.get("swiglu") is False or config.get("gated_linear_unit") is False or hf is not None:
        return GELU
    return None


def from_megatron_args(args: dict, recorded_by: str) -> ModelShape:
    """Megatron-LM's `args` or NeMo's model config (the same names, mostly)."""
    groups = _get(args, "num_query_groups") if _get(args, "group_query_attention") in (None, True) else None
    heads = _get(args, "num_attention_heads")
    untie = _get(args, "untie_embeddings_and_output_weights")
    share = _get(args, "share_embeddings_and_output_weights")
    bias = _get(args, "add_bias_linear")
    return ModelShape(
        layers=_get(args, "num_layers"),
        hidden=_get(args, "hidden_size"),
        heads=heads,
        query_groups=groups or heads,
        head_dim=_get(args, "kv_channels"),
        ffn=_get(args, "ffn_hidden_size"),
        vocab=_get(args, "padded_vocab_size"),
        norm=_get(args, "normalization"),
        activation=_activation(args),
        position_embedding=_get(args, "position_embedding_type"),
        norm_epsilon=_get(args, "norm_epsilon", "layernorm_epsilon"),
        rope_theta=_get(args, "rotary_base"),
        max_positions=_get(args, "max_position_embeddings", "seq_length"),
        qkv_bias=_get(args, "add_qkv_bias") if _get(args, "add_qkv_bias") is not None else bias,
        linear_bias=bias,
        tied=(not untie) if untie is not None else share,
        experts=_get(args, "num_experts", "num_moe_experts"),
        recorded_by=recorded_by if heads else "",
    )


def from_hf_config(config: dict, where: str) -> ModelShape:
    """A transformers config.json (Llama, Qwen2, GPT-2)."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        return _gpt2_shape(config, where)
    if model_type not in ("llama", "qwen2", "mistral"):
        raise UsageError(f"{where}: model_type {model_type!r}; a Megatron shape is read from llama, qwen2 or gpt2 configs")
    heads = config.get("num_attention_heads")
    bias = bool(config.get("attention_bias")) if model_type != "qwen2" else False
    return ModelShape(
        layers=config.get("num_hidden_layers"),
        hidden=config.get("hidden_size"),
        heads=heads,
        query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim"),
        ffn=config.get("intermediate_size"),
        norm=RMSNORM,
        activation=SWIGLU,
        position_embedding=ROPE,
        norm_epsilon=config.get("rms_norm_eps"),
        rope_theta=config.get("rope_theta"),
        max_positions=config.get("max_position_embeddings"),
        qkv_bias=model_type == "qwen2" or bias,
        linear_bias=bias or bool(config.get("mlp_bias")),
        tied=bool(config.get("tie_word_embeddings", model_type != "llama")),
        recorded_by=where,
    )


GPT2_ACTIVATIONS = {"gelu": GELU, "gelu_new": GELU_TANH, "gelu_pytorch_tanh": GELU_TANH}


def _gpt2_shape(config: dict, where: str) -> ModelShape:
    """A GPT-2 config: LayerNorm, GELU, learned positions, biases everywhere, one key head per query head."""
    activation = GPT2_ACTIVATIONS.get(config.get("activation_function", "gelu_new"))
    if activation is None or config.get("scale_attn_by_inverse_layer_idx") or config.get("scale_attn_weights") is False:
        raise DataCheckError(
            f"{where}: activation_function {config.get('activation_function')!r}, scale_attn_weights {config.get('scale_attn_weights')},"
            f" scale_attn_by_inverse_layer_idx {config.get('scale_attn_by_inverse_layer_idx')}: Megatron's GPT takes gelu or"
            " gelu_new, attention scaled by 1/sqrt(head size)"
        )
    heads = config.get("n_head")
    return ModelShape(
        layers=config.get("n_layer"),
        hidden=config.get("n_embd"),
        heads=heads,
        query_groups=heads,
        ffn=config.get("n_inner") or 4 * int(config.get("n_embd") or 0) or None,
        norm=LAYERNORM,
        activation=activation,
        position_embedding=LEARNED,
        norm_epsilon=config.get("layer_norm_epsilon"),
        max_positions=config.get("n_positions"),
        qkv_bias=True,
        linear_bias=True,
        tied=bool(config.get("tie_word_embeddings", True)),
        recorded_by=where,
    )


def checked(shape: ModelShape, where: str) -> ModelShape:
    """The shape with its head size worked out; a DataCheckError when heads do not divide."""
    if shape.heads is None or shape.hidden is None:
        return shape
    groups = shape.query_groups or shape.heads
    if shape.heads % groups:
        raise DataCheckError(f"{where}: {shape.heads} attention heads in {groups} query groups do not divide")
    return replace(shape, query_groups=groups, head_dim=shape.head_dim or shape.hidden // shape.heads)


def shape_of_model(spec: str) -> ModelShape:
    """`--model hf:DIR`: the shape its config.json gives."""
    import json
    from pathlib import Path

    config_path = Path(spec.removeprefix("hf:")) / "config.json"
    if not spec.startswith("hf:") or not config_path.is_file():
        raise UsageError(
            f"--model {spec!r}: a Megatron checkpoint's shape is read from hf:DIR, a directory with a transformers config.json"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError:
        raise UsageError(f"{config_path}: not JSON") from None
    return from_hf_config(config, str(config_path))


def megatron_args(shape: ModelShape) -> dict[str, Any]:
    """The shape as Megatron-LM's `args` name it (what a checkpoint fsdpkit writes records)."""
    return {
        "num_layers": shape.layers,
        "hidden_size": shape.hidden,
        "num_attention_heads": shape.heads,
        "group_query_attention": shape.query_groups != shape.heads,
        "num_query_groups": shape.query_groups,
        "kv_channels": shape.head_dim,
        "ffn_hidden_size": shape.ffn,
        "padded_vocab_size": shape.vocab,
        "normalization": shape.norm,
        "swiglu": shape.activation == SWIGLU,
        "openai_gelu": shape.activation == GELU_TANH,
        "position_embedding_type": shape.position_embedding,
        "norm_epsilon": shape.norm_epsilon,
        "rotary_base": shape.rope_theta,
        "max_position_embeddings": shape.max_positions,
        "add_qkv_bias": bool(shape.qkv_bias),
        "add_bias_linear": bool(shape.linear_bias),
        "untie_embeddings_and_output_weights": not shape.tied,
    }
