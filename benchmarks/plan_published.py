"""`fsdpkit plan --time` against throughput others measured on GPU clusters: the FSDP paper's
GPT-175B (arXiv 2304.11277, section 6.3: TFLOPS per A100 80GB at 128-512 GPUs) and
torchtitan's Llama 3.1 8B with FSDP on 8 H100s (docs/performance.md, Table 1) and on 64
A100s (docs/performance.md, Llama 3 on 64 A100). Only the meta-device model is built.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_published.py

The models are package.module:factory specs (this directory on PYTHONPATH), so the same
predictions come from the command line:

    PYTHONPATH=benchmarks fsdpkit plan --model plan_published:llama3_8b --world-size 8 --time \\
        --hardware h100-ib400 --mixed-precision bf16 --seq-len 8192 --global-batch-size 16
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    from fsdpkit.hardware import load
    from fsdpkit.memory_plan import PlanRequest
    from fsdpkit.step_time import Recompute
    from fsdpkit.time_plan import model_costs, predict
    from fsdpkit.train.config import TrainConfig

    costs = {}
    print("| source | configuration | published | predicted | ratio | step s | exposed comm s | MFU | model TFLOPS/GPU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for source, text, model, world, hardware, batch, seq_len, sharding, metric, published, recompute in ANCHORS:
        values = {"model": {"name": model}, "data": {"global_batch_size": batch * world, "seq_len": seq_len}, "sharding": sharding}
        request = PlanRequest(TrainConfig.from_values(values), world)
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


if __name__ == "__main__":
    main()
