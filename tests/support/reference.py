"""The unsharded single-process training loop the training tests compare fsdpkit against:
AdamW with the nanoGPT parameter groups, the run's learning-rate schedule, gradient
accumulation over the global batch, the same (seed, step) batches as `fsdpkit train`."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import fsdpkit
from fsdpkit.train.config import TrainConfig
from fsdpkit.train.data import TokenSource
from fsdpkit.train.schedule import lr_at


def train_unsharded(
    model: torch.nn.Module, logits: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], data: TokenSource, config: TrainConfig
) -> dict:
    """{"losses": per-step loss, "weights": the final state_dict} of `config.steps` steps."""
    hyper = config.optimizer
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=hyper.weight_decay), lr=config.peak_lr, betas=hyper.betas)
    losses = []
    for step in range(config.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(
                step, base_lr=config.peak_lr, warmup_steps=config.warmup_steps, total_steps=config.steps, schedule=hyper.schedule
            )
        step_loss = 0.0
        for micro in data.global_batch(step, config.data.global_batch_size).chunk(config.data.grad_accum):
            loss = F.cross_entropy(logits(model, micro[:, :-1]).flatten(0, 1), micro[:, 1:].flatten()) / config.data.grad_accum
            loss.backward()
            step_loss += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return {"losses": losses, "weights": model.state_dict()}
