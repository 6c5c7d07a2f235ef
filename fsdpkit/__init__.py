"""fsdpkit: Fully Sharded Data Parallel training as the PyTorch FSDP paper describes it.

    import fsdpkit
    model = fsdpkit.shard(model, wrap=(Block,))
    optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=3e-4)
    with fsdpkit.full_params(model):
        ...  # full weights for evaluation or export
    fsdpkit.save(model, optimizer, "run", step=100)
    with fsdpkit.open_checkpoint("run") as checkpoint:  # any format: fsdpkit, full, DCP, DeepSpeed
        checkpoint.get_slice("wte.weight")[:10]

Names are imported on first use, so the commands that need no torch (convert, reshard,
inspect, verify, plan) never load it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "shard": "fsdpkit.engine.api",
    "full_params": "fsdpkit.engine.api",
    "full_state_dict": "fsdpkit.engine.api",
    "no_sync": "fsdpkit.engine.api",
    "param_groups": "fsdpkit.engine.api",
    "original_shape": "fsdpkit.engine.api",
    "comm_stats": "fsdpkit.engine.api",
    "memory_stats": "fsdpkit.engine.api",
    "reset_peak_memory": "fsdpkit.engine.api",
    "recorded_events": "fsdpkit.engine.api",
    "is_sharded": "fsdpkit.engine.api",
    "local_shard_bytes": "fsdpkit.engine.api",
    "clip_grad_norm_": "fsdpkit.engine.clip",
    "ShardedGradScaler": "fsdpkit.engine.grad_scaler",
    "Checkpointer": "fsdpkit.checkpoint.live.checkpointer",
    "save": "fsdpkit.checkpoint.live.checkpointer",
    "load": "fsdpkit.checkpoint.live.checkpointer",
    "open_checkpoint": "fsdpkit.checkpoint.offline.formats",
    "MixedPrecision": "fsdpkit.engine.config",
    "ShardingConfig": "fsdpkit.engine.config",
    "WrapPolicy": "fsdpkit.engine.wrapping",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
