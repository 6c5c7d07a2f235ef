"""Starting a training run: validate everything before a process starts, then launch."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..errors import UsageError
from ..launch import LaunchOptions, launch
from .config import TrainConfig
from .data import read_byte_tokens
from .checkpointing import check_before_launch
from .loop import train_worker
from .model_setup import inspect_model


def validate(config: TrainConfig, world_size: int) -> None:
    """Every check that does not need a process group: exit 2 before launching."""
    config.validate_world_size(world_size)
    info = inspect_model(config.model, config.vocab_size, config.wrap, min_params=config.wrap_min_params, every=config.wrap_every)
    if info.block_size is not None and config.seq_len > info.block_size:
        raise UsageError(f"--seq-len {config.seq_len} exceeds model {config.model!r} block size {info.block_size}")
    if config.data != "synthetic":
        read_byte_tokens(config.data, seq_len=config.seq_len, vocab_size=info.vocab_size)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda requested but no CUDA device is available")
    if config.resume:
        check_before_launch(config, config.resume, with_optimizer=True)
    if config.init_from:
        check_before_launch(config, config.init_from, with_optimizer=False)
    if config.save_dir and os.path.exists(config.save_dir) and not os.path.isdir(config.save_dir):
        raise UsageError(f"--save-dir {config.save_dir!r} exists and is not a directory")
    if config.metrics:
        directory = os.path.dirname(os.path.abspath(config.metrics))
        if not os.path.isdir(directory):
            raise UsageError(f"--metrics {config.metrics!r}: directory {directory!r} does not exist")


def run_training(config: TrainConfig, options: LaunchOptions) -> dict[str, Any] | None:
    """Validate, launch the workers, and return rank 0's summary (None on other nodes)."""
    validate(config, options.world_size)
    results = launch(_worker_entry, config, options=options)
    return results.get(0)


@record
def _worker_entry(config: TrainConfig) -> dict[str, Any] | None:
    return run_in_process_group(config)


def run_in_process_group(config: TrainConfig) -> dict[str, Any] | None:
    """Init the process group from the launcher's environment (elastic launcher or torchrun),
    train, tear down."""
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        return train_worker(config)
    finally:
        dist.destroy_process_group()
