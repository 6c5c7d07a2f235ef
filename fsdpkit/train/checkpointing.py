"""Checkpoints in training: what the training state holds, resuming exactly, and checking a
checkpoint before any process starts (the checkpoint side is fsdpkit.checkpoint.state)."""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import torch

from ..checkpoint.state import check_before_launch as check_checkpoint
from ..models.registry import build_model

if TYPE_CHECKING:
    from .config import TrainConfig
    from .loop import Trainer

OPTIMIZER_CLASS = {"adamw": "AdamW", "sgd": "SGD"}


def training_state(trainer: "Trainer") -> dict:
    """World-size independent: the data stream is a function of (seed, step), the learning
    rate of the optimizer step count; the RNG state is the same on every rank."""
    config = trainer.config
    return {
        "step": trainer.step,
        "optimizer_steps": trainer.optimizer_steps,
        "samples": trainer.step * config.global_batch_size,
        "lr_schedule": {"kind": config.lr_schedule, "position": trainer.optimizer_steps,
                        "warmup_steps": config.warmup_steps, "base_lr": config.lr,
                        "decay_steps": config.schedule_steps},
        "grad_scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "rng": {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")},
        "world_size": trainer.world_size,
        "config": config.to_json(),
    }


def apply_training_state(trainer: "Trainer", state: dict) -> None:
    trainer.step = int(state.get("step", 0))
    trainer.optimizer_steps = int(state.get("optimizer_steps", trainer.step))
    if trainer.scaler is not None and state.get("grad_scaler"):
        trainer.scaler.load_state_dict(state["grad_scaler"])
    rng = (state.get("rng") or {}).get("torch_cpu")
    if rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))


def check_before_launch(config: "TrainConfig", path: str, *, with_optimizer: bool) -> None:
    """Validate a --resume / --init-from checkpoint against the model, on the meta device:
    any problem is a DataCheckError (exit 3) before a process starts."""
    check_checkpoint(path, model=build_model(config.model, device="meta"),
                     optimizer_type=OPTIMIZER_CLASS[config.optimizer] if with_optimizer else None,
                     strict=config.strict)
