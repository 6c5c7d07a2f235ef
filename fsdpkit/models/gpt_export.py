"""The built-in GPT as transformers' GPT2LMHeadModel (no torch).

The built-in GPT is GPT-2's architecture: the same names under `transformer.` (but the output
head), the same math (LayerNorm eps 1e-5, GELU tanh = transformers' "gelu_new", attention
scaled by 1/sqrt(head dim), a tied output head, biases everywhere but the head, no dropout),
but nn.Linear weights (out, in) where GPT-2 has Conv1D weights (in, out). So an export adds
the prefix, stores those four weights transposed, and writes a GPT2Config.
"""

from __future__ import annotations

from ..checkpoint.core.export import ExportLayout, HfExport

CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
GPT2_LAYOUT = ExportLayout(prefix="transformer.", unprefixed=("lm_head.weight",), transposed=CONV1D_WEIGHTS)


def gpt2_export(config) -> HfExport:
    """`config`: a GPTConfig (vocab_size, block_size, n_layer, n_head, n_embd)."""
    document = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": config.vocab_size - 1,
        "eos_token_id": config.vocab_size - 1,
    }
    return HfExport(document, layout=GPT2_LAYOUT)
