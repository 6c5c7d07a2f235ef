"""Sharding configuration: frozen dataclasses validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UsageError

STRATEGIES = ("full", "grad-op", "hybrid", "none")
BACKWARD_PREFETCH = ("pre", "post", "none")


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for the unsharded parameters, the gradient reduction and the buffers.

    None means: keep the master dtype (fp32).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    @classmethod
    def from_name(cls, name: str) -> "MixedPrecision":
        dtypes = {"none": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
        if name not in dtypes:
            raise UsageError(f"unknown mixed precision {name!r}: use one of bf16, fp16, none")
        dtype = dtypes[name]
        # bf16 keeps the reduction in bf16 (as the paper's runs); fp16 reduces in fp32 to avoid overflow.
        return cls(param_dtype=dtype, reduce_dtype=torch.float32 if dtype is torch.float16 else dtype, buffer_dtype=None)

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None


@dataclass(frozen=True)
class ShardingConfig:
    """How a model is sharded.

    strategy: full (FULL_SHARD), grad-op (SHARD_GRAD_OP), hybrid (HYBRID_SHARD), none (NO_SHARD).
    shard_group_size: ranks a parameter is sharded over with `hybrid`.
    """

    strategy: str = "full"
    shard_group_size: int | None = None
    mixed_precision: MixedPrecision = MixedPrecision()
    backward_prefetch: str = "pre"
    forward_prefetch: bool = False
    limit_all_gathers: int = 2
    cpu_offload: bool = False
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.backward_prefetch not in BACKWARD_PREFETCH:
            raise UsageError(f"unknown backward prefetch {self.backward_prefetch!r}: use one of {', '.join(BACKWARD_PREFETCH)}")
        if self.limit_all_gathers < 0:
            raise UsageError(f"limit on in-flight all-gathers must be >= 0 (0: no limit), got {self.limit_all_gathers}")
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown sharding strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.strategy == "hybrid" and self.shard_group_size is None:
            raise UsageError("strategy 'hybrid' needs a shard group size (--shard-group-size)")
        if self.strategy != "hybrid" and self.shard_group_size is not None:
            raise UsageError(f"--shard-group-size {self.shard_group_size} only applies to strategy 'hybrid', not {self.strategy!r}")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise UsageError(f"shard group size must be >= 1, got {self.shard_group_size}")

    def validate_world_size(self, world_size: int) -> None:
        if world_size < 1:
            raise UsageError(f"world size must be >= 1, got {world_size}")
        if self.strategy == "hybrid" and world_size % self.shard_group_size:
            raise UsageError(f"world size {world_size} is not divisible by shard group size {self.shard_group_size}")

    def shard_factor(self, world_size: int) -> int:
        self.validate_world_size(world_size)
        return {"full": world_size, "grad-op": world_size, "none": 1}.get(self.strategy) or self.shard_group_size

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in ("full", "hybrid")
