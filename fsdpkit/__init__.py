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
    no_sync,
    param_groups,
    recorded_events,
    reset_peak_memory,
    shard,
)
from .engine.checkpoint_io import Checkpointer, load, save
from .engine.clip import clip_grad_norm_
from .engine.config import MixedPrecision, ShardingConfig
from .engine.grad_scaler import ShardedGradScaler
from .engine.plan import WrapPolicy

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "MixedPrecision",
    "load",
    "save",
    "ShardedGradScaler",
    "clip_grad_norm_",
    "ShardingConfig",
    "WrapPolicy",
    "comm_stats",
    "full_params",
    "full_state_dict",
    "is_sharded",
    "local_shard_bytes",
    "memory_stats",
    "original_shape",
    "no_sync",
    "param_groups",
    "recorded_events",
    "reset_peak_memory",
    "shard",
]
