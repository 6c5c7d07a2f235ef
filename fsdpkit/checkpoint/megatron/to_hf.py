"""A Megatron GPT model's tensors and config.json as transformers loads them (pure): the
architecture `hf.architecture_of` picks, each tensor a range view of the stored ones."""

from __future__ import annotations

from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourceTensor
from . import hf
from .shape import GELU_TANH, ModelShape

NEEDED = ("layers", "hidden", "heads", "query_groups", "head_dim", "ffn", "vocab", "norm", "activation", "position_embedding")


def hf_model(model: dict[str, SourceTensor], shape: ModelShape, where: str) -> hf.HfModel:
    """`model`: Megatron's tensors by the model's names (layers unstacked); `shape` complete."""
    missing = shape.missing(*NEEDED)
    if missing:
        raise DataCheckError(
            f"{where}: the checkpoint does not record the model's {', '.join(missing)}: name a transformers config with --model hf:DIR"
        )
    architecture = hf.architecture_of(shape, where)
    assert shape.layers is not None
    tied = "output_layer.weight" not in model
    tensors: list[SourceTensor] = []
    if architecture == hf.GPT2:
        tensors.append(_named(hf.top_tensor(model, "embedding.word_embeddings.weight", where), "transformer.wte.weight"))
        tensors.append(_named(hf.top_tensor(model, "embedding.position_embeddings.weight", where), "transformer.wpe.weight"))
        for i in range(shape.layers):
            tensors += hf.gpt2_layer(hf.LayerTensors(model, i, where), shape, f"transformer.h.{i}")
        tensors.append(_named(hf.top_tensor(model, "decoder.final_layernorm.weight", where), "transformer.ln_f.weight"))
        tensors.append(_named(hf.top_tensor(model, "decoder.final_layernorm.bias", where), "transformer.ln_f.bias"))
    else:
        bias = {"qkv": bool(shape.qkv_bias), "linear": bool(shape.linear_bias) and architecture == hf.LLAMA}
        tensors.append(_named(hf.top_tensor(model, "embedding.word_embeddings.weight", where), "model.embed_tokens.weight"))
        for i in range(shape.layers):
            tensors += hf.llama_layer(hf.LayerTensors(model, i, where), shape, f"model.layers.{i}", bias)
        tensors.append(_named(hf.top_tensor(model, "decoder.final_layernorm.weight", where), "model.norm.weight"))
    if not tied:
        tensors.append(_named(model["output_layer.weight"], "lm_head.weight"))
    config = gpt2_config(shape, tied) if architecture == hf.GPT2 else llama_config(shape, tied, architecture)
    tensors.sort(key=_stored_at)  # in the order their bytes lie: the copy reads each file front to back
    return hf.HfModel(architecture, tensors, config, hf.GPT2_TRANSPOSED if architecture == hf.GPT2 else ())


def _stored_at(tensor: SourceTensor) -> tuple[str, int]:
    first = tensor.pieces_in(ElementRange(0, 1))
    return (str(first[0].path), first[0].offset) if first else ("", 0)


def _named(source: SourceTensor, name: str) -> SourceTensor:
    return hf.renamed(source, name)


def llama_config(shape: ModelShape, tied: bool, architecture: str) -> dict:
    config = {
        "architectures": [architecture],
        "model_type": "qwen2" if architecture == hf.QWEN2 else "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.ffn,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.query_groups,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "hidden_act": "silu",
        "rms_norm_eps": shape.norm_epsilon or 1e-5,
        "rope_theta": shape.rope_theta or 10000.0,
        "max_position_embeddings": shape.max_positions or 4096,
        "tie_word_embeddings": tied,
        "attention_dropout": 0.0,
    }
    if architecture == hf.LLAMA:
        config |= {"attention_bias": bool(shape.linear_bias), "mlp_bias": bool(shape.linear_bias)}
    else:
        config |= {"use_sliding_window": False}
    return config


def gpt2_config(shape: ModelShape, tied: bool) -> dict:
    if shape.head_dim != (shape.hidden or 0) // (shape.heads or 1):
        raise DataCheckError(f"heads of {shape.head_dim} channels in a hidden size of {shape.hidden}: GPT-2 needs hidden / heads")
    return {
        "architectures": [hf.GPT2],
        "model_type": "gpt2",
        "n_embd": shape.hidden,
        "n_layer": shape.layers,
        "n_head": shape.heads,
        "n_inner": shape.ffn,
        "n_positions": shape.max_positions,
        "vocab_size": shape.vocab,
        "layer_norm_epsilon": shape.norm_epsilon or 1e-5,
        "activation_function": "gelu_new" if shape.activation == GELU_TANH else "gelu",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": tied,
    }
