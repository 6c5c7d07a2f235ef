"""The training config without processes: sections, plain values, TOML, the world-size check."""

from __future__ import annotations

import tomllib

import pytest
import torch

from fsdpkit.dist.launch import LaunchOptions
from fsdpkit.engine.config import ShardingConfig
from fsdpkit.errors import UsageError
from fsdpkit.settings import to_toml
from fsdpkit.train.config import (
    CheckpointConfig,
    DataConfig,
    Device,
    LoggingConfig,
    LrSchedule,
    ModelConfig,
    Optimizer,
    OptimizerConfig,
    TrainConfig,
    precision_names,
    precision_policy,
)

NOT_DEFAULT = TrainConfig(
    steps=7,
    seed=3,
    device=Device.CPU,
    model=ModelConfig(name="gpt-small", wrap=("a.b:C", "d.e:F"), wrap_min_params=100, wrap_every=2, deferred_init=False),
    data=DataConfig(source="corpus.txt", seq_len=16, global_batch_size=12, grad_accum=3, no_sync=True, eval_every=2, eval_batches=2),
    sharding=ShardingConfig(
        strategy="hybrid",
        shard_group_size=2,
        mixed_precision=precision_policy("bf16", "fp32"),
        backward_prefetch="post",
        forward_prefetch=True,
        limit_all_gathers=0,
        cpu_offload=True,
        activation_checkpointing=True,
        compile=True,
    ),
    optimizer=OptimizerConfig(
        name=Optimizer.SGD,
        lr=1e-5,
        weight_decay=0.0,
        betas=(0.8, 0.99),
        max_grad_norm=1.5,
        schedule=LrSchedule.COSINE,
        warmup_steps=1,
        decay_steps=100,
    ),
    checkpoint=CheckpointConfig(save_dir="run", save_every=2, keep_last=3, async_save=True, resume="old", strict=False),
    logging=LoggingConfig(metrics="m.jsonl", tensorboard="tb", log_every=3, log_seconds=0.5, quiet=True),
    launch=LaunchOptions(
        nproc_per_node=4, nnodes=2, node_rank=1, rdzv_backend="static", rdzv_id="x", master_addr="node0", master_port=1234
    ),
)


def test_every_setting_round_trips_through_plain_values_and_toml():
    values = NOT_DEFAULT.to_values()
    assert TrainConfig.from_values(values) == NOT_DEFAULT
    assert TrainConfig.from_values(tomllib.loads(to_toml(values))) == NOT_DEFAULT
    assert TrainConfig.from_values({}) == TrainConfig()
    assert TrainConfig.from_values(tomllib.loads(to_toml(TrainConfig().to_values()))) == TrainConfig()


def test_sections_are_nested_as_the_config_object():
    values = NOT_DEFAULT.to_values()
    assert values["steps"] == 7 and values["device"] == "cpu"
    assert values["optimizer"]["name"] == "sgd" and values["optimizer"]["betas"] == [0.8, 0.99]
    assert values["sharding"]["mixed_precision"] == "bf16" and values["sharding"]["reduce_dtype"] == "fp32"
    assert values["launch"]["master_addr"] == "node0"
    assert NOT_DEFAULT.launch.endpoint == "node0:1234" and NOT_DEFAULT.launch.world_size == 8


@pytest.mark.parametrize(
    "name, reduce_dtype, param, reduce",
    [
        ("none", None, None, None),
        ("bf16", None, torch.bfloat16, torch.bfloat16),
        ("fp16", None, torch.float16, torch.float32),
        ("bf16", "fp32", torch.bfloat16, torch.float32),
        ("fp16", "fp16", torch.float16, torch.float16),
    ],
)
def test_mixed_precision_by_name_and_back(name, reduce_dtype, param, reduce):
    policy = precision_policy(name, reduce_dtype)
    assert policy.param_dtype is param and policy.reduce_dtype is reduce
    assert precision_names(policy) == (name, reduce_dtype)


def test_world_size_is_checked_in_one_place():
    config = TrainConfig(data=DataConfig(global_batch_size=12, grad_accum=3))
    config.check_world_size(4)
    with pytest.raises(UsageError, match="--global-batch-size 12 is not divisible by world size 8 x --grad-accum 3 = 24"):
        config.check_world_size(8)
    hybrid = TrainConfig(sharding=ShardingConfig(strategy="hybrid", shard_group_size=3), data=DataConfig(global_batch_size=12))
    with pytest.raises(UsageError, match="world size 4 is not divisible by shard group size 3"):
        hybrid.check_world_size(4)
