"""Engine configuration without processes: strategies and backward prefetch as enums that
other code still writes as strings, and the mixed-precision presets with their reduction
dtype."""

from __future__ import annotations

import json

import pytest
import torch

from fsdpkit.engine.config import BackwardPrefetch, MixedPrecision, ShardingConfig, Strategy
from fsdpkit.errors import UsageError


def test_strategy_and_prefetch_are_enums_equal_to_their_strings():
    config = ShardingConfig(strategy="grad-op", backward_prefetch="post")
    assert config.strategy is Strategy.GRAD_OP and config.strategy == "grad-op" and str(config.strategy) == "grad-op"
    assert config.backward_prefetch is BackwardPrefetch.POST and config.backward_prefetch == "post"
    assert json.dumps({"strategy": config.strategy}) == '{"strategy": "grad-op"}'
    assert ShardingConfig(strategy=Strategy.HYBRID, shard_group_size=2) == ShardingConfig(strategy="hybrid", shard_group_size=2)
    assert not ShardingConfig(strategy="grad-op").reshard_after_forward and ShardingConfig().reshard_after_forward
    with pytest.raises(UsageError, match="unknown backward prefetch 'later': use one of pre, post, none"):
        ShardingConfig(backward_prefetch="later")
    with pytest.raises(UsageError, match="--shard-group-size 2 only applies to strategy 'hybrid', not 'full'"):
        ShardingConfig(shard_group_size=2)


@pytest.mark.parametrize(
    "name, reduce_dtype, expected",
    [
        ("bf16", None, (torch.bfloat16, torch.bfloat16, torch.bfloat16)),  # the paper's low-precision reduction
        ("bf16", "fp32", (torch.bfloat16, torch.float32, torch.bfloat16)),  # FSDP2's MixedPrecisionPolicy(bf16, fp32)
        ("fp16", None, (torch.float16, torch.float32, torch.float16)),  # fp16 sums overflow: fp32
        ("fp16", "fp16", (torch.float16, torch.float16, torch.float16)),
        ("fp32", None, (None, None, None)),
        ("none", "fp32", (None, None, None)),
        ("none", "bf16", (None, torch.bfloat16, None)),
    ],
)
def test_mixed_precision_presets_and_reduce_dtype(name, reduce_dtype, expected):
    policy = MixedPrecision.from_name(name, reduce_dtype=reduce_dtype)
    assert (policy.param_dtype, policy.reduce_dtype, policy.buffer_dtype) == expected


def test_mixed_precision_names_are_checked():
    with pytest.raises(UsageError, match="unknown mixed precision 'int8': use one of bf16, fp16, fp32, none"):
        MixedPrecision.from_name("int8")
    with pytest.raises(UsageError, match="unknown reduce dtype 'fp64': use one of bf16, fp16, fp32"):
        MixedPrecision.from_name("bf16", reduce_dtype="fp64")
