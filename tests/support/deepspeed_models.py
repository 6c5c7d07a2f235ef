"""DeepSpeed ZeRO-3 runs of transformers' GPT-2 and Llama shaped as the Megatron oracle's tiny
models (`megatron_oracle.shape("gpt" | "llama", num_layers=2)`), one AdamW step each at 2 gloo
ranks on CPU, saved by DeepSpeed's own `engine.save_checkpoint` (no config.json: DeepSpeed
writes none). `configs` gives the transformers configs the test process builds the same models from."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

VOCAB, HIDDEN, HEADS, POSITIONS = 128, 64, 4, 32  # megatron_oracle.shape's defaults


def configs() -> dict:
    """{"gpt2": GPT2Config, "llama": LlamaConfig} of the oracle's "gpt" (openai_gelu) and "llama" shapes."""
    import transformers

    gpt2 = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=2, n_head=HEADS, n_inner=256,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    )  # fmt: skip
    return {"gpt2": gpt2, "llama": llama}


def save_zero3(root: str) -> None:
    """root/gpt2 and root/llama: DeepSpeed save directories of one ZeRO-3 AdamW step each."""
    import deepspeed
    import torch
    import transformers

    from support.deepspeed_worker import init_deepspeed

    init_deepspeed()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "steps_per_print": 10**6}
    for name, model_config in configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(model_config)
        with torch.no_grad():  # norms and biases off 1 and 0
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config | {"zero_allow_untested_optimizer": True})
        ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1 + int(os.environ["RANK"])))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        engine.save_checkpoint(os.path.join(root, name))
