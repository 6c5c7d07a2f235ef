"""`fsdpkit plan --time` against throughput others measured on GPU clusters: the FSDP paper's
GPT-175B (arXiv 2304.11277, section 6.3: TFLOPS per A100 80GB at 128-512 GPUs) and T5-11B
(the change of TFLOPS per GPU from 8 to 512 GPUs, the one T5 figure its text states), and
torchtitan's Llama 3.1 8B with FSDP on 8 H100s (docs/performance.md, Table 1) and on 64
A100s (docs/performance.md, Llama 3 on 64 A100). Only the meta-device model is built.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_published.py

The models are package.module:factory specs (this directory on PYTHONPATH), so the same
predictions come from the command line:

    PYTHONPATH=benchmarks fsdpkit plan --model plan_published:llama3_8b --world-size 8 --time \\
        --hardware h100-96gb-ib400 --mixed-precision bf16 --seq-len 8192 --global-batch-size 16
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def gpt_175b():
    """minGPT-175B as the paper ran it: 96 layers, width 12288, 96 heads, vocab 50000, block 2048."""
    from fsdpkit.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=50000, block_size=2048, n_layer=96, n_head=96, n_embd=12288))


def llama3_8b():
    """Llama 3 8B: 32 layers, width 4096, SwiGLU 14336, 32 heads with 8 key/value heads, vocab 128256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


class TextToText(torch.nn.Module):
    """An encoder-decoder called as a language model: the same tokens go to the encoder and,
    as the decoder's input, to the decoder (the step's work is that of both stacks)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, decoder_input_ids=ids).logits


def t5_11b():
    """T5-11B (the released t5-11b config): 24 encoder and 24 decoder blocks, width 1024, 128
    heads of 128, feed-forward 65536 (ReLU), vocab 32128, tied embeddings."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=32128, d_model=1024, d_kv=128, d_ff=65536, num_layers=24, num_decoder_layers=24, num_heads=128, dropout_rate=0.0
    )
    return TextToText(T5ForConditionalGeneration(config))


# source, configuration, model, world size, hardware, per-rank batch, seq len, sharding, metric, published figure,
# the checkpointing the run recomputes that the engine's flags cannot say (torchtitan's selective op policy)
ANCHORS = [
    (
        "FSDP paper, GPT-175B (sec. 6.3)",
        "128 A100 80GB, 2 Tb/s RoCE per node, full shard, bf16, checkpointing, batch 1",
        "plan_published:gpt_175b",
        128,
        "a100-80gb-ib200",
        1,
        2048,
        {"strategy": "full", "mixed_precision": "bf16", "activation_checkpointing": True},
        "tflops",
        173.0,
        None,
    ),
    (
        "FSDP paper, GPT-175B (sec. 6.3)",
        "512 A100 80GB, as above, batch 2",
        "plan_published:gpt_175b",
        512,
        "a100-80gb-ib200",
        2,
        2048,
        {"strategy": "full", "mixed_precision": "bf16", "activation_checkpointing": True},
        "tflops",
        186.0,
        None,
    ),
    (
        "torchtitan docs/performance.md, Table 1",
        "Llama 3.1 8B, 8 H100, FSDP, bf16, local batch 2, seq 8192, selective checkpointing",
        "plan_published:llama3_8b",
        8,
        "h100-96gb-ib400",
        2,
        8192,
        {"strategy": "full", "mixed_precision": "bf16"},
        "tokens",
        5762.0,
        "selective",
    ),
    (
        "torchtitan docs/performance.md, Llama 3 on 64 A100",
        "Llama 3 8B, 64 A100 80GB, FSDP, bf16, local batch 1, seq 8192, selective op checkpointing",
        "plan_published:llama3_8b",
        64,
        "a100-80gb-ib200",
        1,
        8192,
        {"strategy": "full", "mixed_precision": "bf16"},
        "tokens",
        2973.0,
        "selective",
    ),
]


def main() -> None:
    from fsdpkit.plan.predict import model_costs, predict
    from fsdpkit.plan.profile import load
    from fsdpkit.plan.simulate import Recompute
    from fsdpkit.train.config import TrainConfig

    costs = {}
    print("| source | configuration | published | predicted | ratio | step s | exposed comm s | MFU | model TFLOPS/GPU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for source, text, model, world, hardware, batch, seq_len, sharding, metric, published, recompute in ANCHORS:
        values = {"model": {"name": model}, "data": {"global_batch_size": batch * world, "seq_len": seq_len}, "sharding": sharding}
        request = TrainConfig.from_values(values).plan_request(world)
        key = (model, seq_len)
        if key not in costs:
            costs[key] = model_costs(request)
        time = predict(request, load(hardware), costs[key], recompute=Recompute(recompute) if recompute else None).time
        if metric == "tflops":  # counted with checkpointing's recompute; the model-FLOPs figure is in the last column
            predicted, unit = time.hardware_tflops_per_device, "TFLOPS/GPU"
        else:
            predicted, unit = time.tokens_per_s / world, "tokens/s/GPU"
        print(
            f"| {source} | {text} ({hardware}) | {published:,.0f} {unit} | {predicted:,.0f} | {predicted / published:.2f} "
            f"| {time.step_time_s:.3g} | {time.exposed_comm_s:.3g} | {time.mfu:.1%} | {time.tflops_per_device:.0f} |"
        )

    t5_scaling()


def t5_scaling() -> None:
    """The FSDP paper states no T5-11B throughput in its text (only figure 8 shows it); it says
    that TFLOPS per GPU fall 7% from 8 to 512 GPUs (seq 512, batch 8 and 16, full sharding,
    checkpointing, bf16). Predicted: the same change, with each T5Block a unit, as the paper wraps."""
    from fsdpkit.plan.predict import model_costs, predict
    from fsdpkit.plan.profile import load
    from fsdpkit.plan.search import at_world_size
    from fsdpkit.train.config import TrainConfig

    print()
    print("| FSDP paper, T5-11B (sec. 6.3, fig. 8) | batch | TFLOPS/GPU at 8 | at 512 | predicted change | stated change |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    model = {"name": "plan_published:t5_11b", "wrap": ["transformers.models.t5.modeling_t5:T5Block"]}
    sharding = {"strategy": "full", "mixed_precision": "bf16", "activation_checkpointing": True}
    for batch in (8, 16):
        values = {"model": model, "data": {"global_batch_size": batch * 8, "seq_len": 512}, "sharding": sharding}
        request = TrainConfig.from_values(values).plan_request(8)
        costs = model_costs(request)
        hardware = load("a100-80gb-ib200")
        small, large = (predict(at_world_size(request, world), hardware, costs).time for world in (8, 512))
        change = large.hardware_tflops_per_device / small.hardware_tflops_per_device - 1
        print(
            f"| 8 and 512 A100 80GB (a100-80gb-ib200) | {batch} | {small.hardware_tflops_per_device:.0f} "
            f"| {large.hardware_tflops_per_device:.0f} | {change:+.1%} | -7% |"
        )


if __name__ == "__main__":
    main()
