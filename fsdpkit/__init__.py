"""fsdpkit: Fully Sharded Data Parallel training as the PyTorch FSDP paper describes it.

    import fsdpkit
    model = fsdpkit.shard(model, wrap=(Block,))
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=3e-4)
    with fsdpkit.full_params(model):
        ...  # full weights for evaluation or export
"""

from .engine.api import (
    comm_stats,
    full_params,
    full_state_dict,
    is_sharded,
    local_shard_bytes,
    memory_stats,
    original_shape,
    param_groups,
    reset_peak_memory,
    shard,
)
from .engine.config import MixedPrecision, ShardingConfig
from .engine.plan import WrapPolicy

__version__ = "0.1.0"

__all__ = [
    "MixedPrecision",
    "ShardingConfig",
    "WrapPolicy",
    "comm_stats",
    "full_params",
    "full_state_dict",
    "is_sharded",
    "local_shard_bytes",
    "memory_stats",
    "original_shape",
    "param_groups",
    "reset_peak_memory",
    "shard",
]
