"""DeepSpeed runs for the DeepSpeed tests: a small Llama trained a few steps at 2 gloo ranks on
CPU for each layout, saved with DeepSpeed's own `engine.save_checkpoint`, all in one launch.

Layouts: (name, ZeRO stage, precision). The model has an odd vocabulary and hidden size (so
every stage pads), a frozen parameter (the final norm), two parameter groups (no weight decay
on norms) and a buffer-free Llama; `tied` adds tied embeddings.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("DS_BUILD_OPS", "0")

LAYOUTS = (("z1_fp32", 1, "fp32"), ("z2_bf16", 2, "bf16"), ("z3_bf16", 3, "bf16"))
TIED_LAYOUT = ("z2_tied", 2, "fp32")
STEPS = 3


def llama_config(tied: bool = False):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=67,
        hidden_size=36,
        intermediate_size=50,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )


def _model(tied: bool):  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(tied))
    model.model.norm.weight.requires_grad_(False)
    return model


def _ds_config(stage: int, precision: str) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def train_and_save(root: str, name: str, stage: int, precision: str, tied: bool = False) -> list[float]:
    """Train STEPS steps and save to root/name (tag global_stepN and `latest`); the losses."""
    import deepspeed
    import torch

    model = _model(tied)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and "norm" in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(stage, precision))
    generator = torch.Generator().manual_seed(1 + int(os.environ["RANK"]))
    losses = []
    for _ in range(STEPS):
        ids = torch.randint(0, 67, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    engine.save_checkpoint(os.path.join(root, name))
    return losses


def init_deepspeed() -> None:
    """DeepSpeed on CPU over the process group already made (gloo). Its CPU accelerator would
    JIT-compile a shared-memory allreduce op with g++ on first use (minutes on a loaded
    machine); gloo does without it."""
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # type: ignore[attr-defined]
    deepspeed.init_distributed(dist_backend="gloo")


def save_all(root: str) -> dict:
    init_deepspeed()
    out = {}
    for name, stage, precision in LAYOUTS:
        out[name] = train_and_save(root, name, stage, precision)
    name, stage, precision = TIED_LAYOUT
    out[name] = train_and_save(root, name, stage, precision, tied=True)
    return out
