"""The training worker: one process of a sharded run. Started by `fsdpkit train` through
the elastic launcher, or directly under torchrun (`torchrun -m fsdpkit.train ...`)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

import fsdpkit

from .config import TrainConfig
from .data import TokenSource, local_rows
from .model_setup import build_for_training, inspect_model, wrap_policy
from ..checkpoint.state import init_weights_from
from .checkpointing import apply_training_state, training_state
from .schedule import lr_at


def pick_device(config: TrainConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    groups = fsdpkit.param_groups(model, weight_decay=config.weight_decay)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    return torch.optim.SGD(groups, lr=config.lr)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class Trainer:
    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        config.validate_world_size(self.world_size)
        self.device = pick_device(config)
        policy = wrap_policy(config.model, config.wrap, min_params=config.wrap_min_params, every=config.wrap_every)
        info = inspect_model(config.model, config.vocab_size, config.wrap, min_params=config.wrap_min_params, every=config.wrap_every)
        self.vocab_size = info.vocab_size
        model = build_for_training(config.model, config.seed, deferred=config.deferred_init)
        self.model = fsdpkit.shard(model, config.sharding, wrap=policy, device=self.device)
        self.num_params = info.num_params
        self.optimizer = build_optimizer(self.model, config)
        self.scaler = fsdpkit.ShardedGradScaler(self.model) if config.mixed_precision == "fp16" else None
        self.data = TokenSource(config.data, vocab_size=self.vocab_size, seq_len=config.seq_len, seed=config.seed)
        self.step = 0  # training steps run (batches consumed)
        self.optimizer_steps = 0  # steps the optimizer took (fp16 skips do not count)
        self.last_grad_norm: float | None = None
        self.checkpointer = fsdpkit.Checkpointer(self.model, self.optimizer, async_save=config.async_save) if config.save_dir else None
        if config.resume:
            state = fsdpkit.Checkpointer(self.model, self.optimizer).load(config.resume, strict=config.strict)
            if state.get("world_size") not in (None, self.world_size) and self.rank == 0:
                warnings.warn(f"resuming a run saved at world size {state.get('world_size')} at world size {self.world_size}")
            apply_training_state(self, state)
        elif config.init_from:
            init_weights_from(self.model, config.init_from)

    def save(self) -> None:
        self.checkpointer.save(self.config.save_dir, step=self.step, training_state=training_state(self), keep_last=self.config.keep_last)

    def _loss_on(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = tokens.to(self.device)
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

    def _global_mean(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total.item() / self.world_size

    def train_step(self) -> float:
        config = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.optimizer_steps, base_lr=config.lr, warmup_steps=config.warmup_steps, total_steps=config.schedule_steps, schedule=config.lr_schedule)
        batch = self.data.global_batch(self.step, config.global_batch_size)
        micro_rows = config.global_batch_size // config.grad_accum
        local_loss = 0.0
        for micro in range(config.grad_accum):
            micro_batch = local_rows(batch[micro * micro_rows:(micro + 1) * micro_rows], self.rank, self.world_size)
            last = micro == config.grad_accum - 1
            with contextlib.nullcontext() if (last or not config.no_sync) else fsdpkit.no_sync(self.model):
                loss = self._loss_on(micro_batch) / config.grad_accum
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            local_loss += loss.item()
        if config.max_grad_norm is not None:
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            self.last_grad_norm = fsdpkit.clip_grad_norm_(self.model, config.max_grad_norm).item()
        if self.scaler:
            stepped = self.scaler.step(self.optimizer)
        else:
            self.optimizer.step()
            stepped = True
        if self.scaler:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.optimizer_steps += int(stepped)
        return self._global_mean(local_loss)

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = []
        for index in range(self.config.eval_batches):
            batch = self.data.global_batch(index, self.config.global_batch_size, held_out=True)
            losses.append(self._loss_on(local_rows(batch, self.rank, self.world_size)).item())
        return self._global_mean(sum(losses) / len(losses))


def train_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Run a whole training on this rank; rank 0 returns the summary, others None."""
    trainer = Trainer(config)
    rank0 = trainer.rank == 0
    metrics = open(config.metrics, "a", encoding="utf-8") if (rank0 and config.metrics) else None
    tokens_per_step = config.global_batch_size * config.seq_len
    losses, eval_losses = [], []
    progress = tqdm(total=config.steps, initial=trainer.step, desc="train", unit="step", disable=not rank0, dynamic_ncols=True)
    started = time.perf_counter()
    try:
        while trainer.step < config.steps:
            step_start = time.perf_counter()
            loss = trainer.train_step()
            step_time = time.perf_counter() - step_start
            losses.append(loss)
            record: dict[str, Any] = {"step": trainer.step, "loss": loss, "lr": trainer.optimizer.param_groups[0]["lr"],
                                      "step_time_s": step_time, "tokens_per_second": tokens_per_step / step_time}
            if trainer.last_grad_norm is not None:
                record["grad_norm"] = trainer.last_grad_norm
            if trainer.scaler is not None:
                record["loss_scale"] = trainer.scaler.scale_value
            if config.eval_every and trainer.step % config.eval_every == 0:
                record["eval_loss"] = trainer.evaluate()
                eval_losses.append({"step": trainer.step, "loss": record["eval_loss"]})
            if metrics:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            progress.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
            progress.update(1)
            if trainer.checkpointer and config.save_every and trainer.step % config.save_every == 0:
                trainer.save()
        if trainer.checkpointer:
            if not (config.save_every and trainer.step % config.save_every == 0 and losses):
                trainer.save()
            trainer.checkpointer.wait()
    finally:
        progress.close()
        if metrics:
            metrics.close()
    elapsed = time.perf_counter() - started
    peak = torch.tensor([peak_memory_bytes(trainer.device)], dtype=torch.float64, device=trainer.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if not rank0:
        return None
    return {
        "model": config.model,
        "num_params": trainer.num_params,
        "world_size": trainer.world_size,
        "strategy": config.strategy,
        "mixed_precision": config.mixed_precision,
        "device": trainer.device.type,
        "steps": trainer.step,
        "optimizer_steps": trainer.optimizer_steps,
        "global_batch_size": config.global_batch_size,
        "seq_len": config.seq_len,
        "losses": losses,
        "final_loss": losses[-1] if losses else None,
        "eval_losses": eval_losses,
        "tokens_per_second": tokens_per_step * len(losses) / elapsed if elapsed > 0 else None,
        "elapsed_seconds": elapsed,
        "peak_memory_bytes": int(peak.item()),
        "checkpoint": trainer.checkpointer.last_saved if trainer.checkpointer else None,
    }
