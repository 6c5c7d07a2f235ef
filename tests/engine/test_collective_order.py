"""Every rank issues its collectives in the same order, prefetching included: under
TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks each collective's type and shapes across ranks
before running it and raises on any mismatch."""

from __future__ import annotations

import torch.distributed as dist
from support.distributed import run_distributed

from fsdpkit.engine.config import ShardingConfig
from fsdpkit.train.config import DataConfig, OptimizerConfig, TrainConfig
from fsdpkit.train.loop import Trainer


def detail_worker(config: TrainConfig) -> dict:
    backend = dist.get_backend()
    wrapped = type(dist.distributed_c10d._get_default_group()).__name__
    trainer = Trainer(config)
    losses = [trainer.train_step() for _ in range(config.steps)]
    return {"losses": losses, "backend": backend, "group": wrapped, "debug": str(dist.get_debug_level())}


def test_collective_order_is_identical_on_every_rank_under_detail_debug(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    config = TrainConfig(
        steps=3,
        data=DataConfig(global_batch_size=4, seq_len=16, grad_accum=2, no_sync=True),
        sharding=ShardingConfig(forward_prefetch=True, backward_prefetch="pre", limit_all_gathers=2),
        optimizer=OptimizerConfig(max_grad_norm=1.0),
    )
    results = run_distributed(detail_worker, 2, config)
    assert results[0]["debug"].endswith("DETAIL")
    assert results[0]["losses"] == results[1]["losses"] and len(results[0]["losses"]) == 3
