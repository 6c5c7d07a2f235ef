"""DeepSpeed runs for the DeepSpeed tests: a small Llama trained a few steps at 2 gloo ranks on
CPU for each layout, saved with DeepSpeed's own `engine.save_checkpoint`, all in one launch.

Layouts: (name, ZeRO stage, precision). The model has an odd vocabulary and hidden size (so
every stage pads), a frozen parameter (the final norm, its values all different), two parameter groups (no weight decay
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
    frozen = model.model.norm.weight
    with torch.no_grad():  # not all ones: a ZeRO-3 fragment read from the wrong rank would look right
        frozen.copy_(torch.linspace(0.5, 1.5, frozen.numel()))
    frozen.requires_grad_(False)
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


def deepspeed_tensors(save_dir: str) -> dict:
    """What DeepSpeed's own `zero_to_fp32` gives for the checkpoint at `save_dir` (its `latest`
    tag): the weights, and Adam's moments (`optim.<moment>.<name>`) put together by the same
    functions from the optimizer files' moment partitions; `step` and `param_groups` per group
    (torch.load of DeepSpeed's files, no restriction)."""
    import torch
    from deepspeed.utils import zero_to_fp32 as z

    out: dict = {"tensors": z.get_fp32_state_dict_from_zero_checkpoint(save_dir)}
    tag_dir = os.path.join(save_dir, open(os.path.join(save_dir, "latest")).read().strip())
    model_states = z.parse_model_states(z.get_model_state_files(tag_dir))
    optims = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in z.get_optim_files(tag_dir)]
    stage = int(optims[0]["zero_stage"])
    base = [o["base_optimizer_state"] if stage <= 2 else o["optimizer_state_dict"] for o in optims]
    for moment in ("exp_avg", "exp_avg_sq"):
        flats = [[group[moment] for _, group in sorted(b["state"].items())] for b in base]
        merged: dict = {}
        if stage <= 2:
            z._zero2_merge_trainable_params(merged, len(optims), flats, model_states, optims[0].get("param_alignment_paddings"))
        else:
            z._zero3_merge_trainable_params(merged, len(optims), flats, model_states)
        out["tensors"].update({f"optim.{moment}.{name}": t for name, t in z.to_torch_tensor(merged).items()})
    out["steps"] = [float(group["step"]) for _, group in sorted(base[0]["state"].items())]
    out["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in base[0]["param_groups"]]
    out["names"] = [list(shapes) for shapes in model_states[0].param_shapes]
    return out
