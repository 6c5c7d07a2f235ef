"""Sharding configuration: frozen dataclasses validated at construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from ..dtypes import SHORT_NAMES, from_short
from ..errors import UsageError

if TYPE_CHECKING:  # torch is imported when a precision is built: a flag is checked without it
    import torch


class Strategy(enum.StrEnum):
    """How parameters are sharded. Members equal their strings ("full" == Strategy.FULL)."""

    FULL = "full"  # FULL_SHARD: shard over every rank, reshard after forward
    GRAD_OP = "grad-op"  # SHARD_GRAD_OP (ZeRO-2): shard over every rank, keep unsharded from forward to backward
    HYBRID = "hybrid"  # HYBRID_SHARD: FULL_SHARD inside groups of shard_group_size ranks, replicate across them
    NONE = "none"  # NO_SHARD: replicate (DDP)


class BackwardPrefetch(enum.StrEnum):
    """When backward issues the next unit's all-gather (torch FSDP's BACKWARD_PRE / BACKWARD_POST)."""

    PRE = "pre"  # before this unit's gradients are computed: most overlap, one more unit gathered
    POST = "post"  # after them, before their reduction
    NONE = "none"


class GatherDtype(enum.StrEnum):
    """What the weight all-gather moves."""

    COMPUTE = "compute"  # the unit's compute dtype (param_dtype, or the master dtype)
    INT8 = "int8"  # int8 values in blocks of quant_block elements, one fp32 scale per block


STRATEGIES = tuple(Strategy)
GATHER_DTYPES = tuple(GatherDtype)
BACKWARD_PREFETCH = tuple(BackwardPrefetch)

E = TypeVar("E", bound=enum.StrEnum)


def parse_enum(kind: type[E], value: str, what: str) -> E:
    """The member of `kind` named `value` (a member is its own name); a UsageError listing the
    names otherwise."""
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"unknown {what} {value!r}: use one of {', '.join(kind)}") from None


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for the unsharded parameters, the gradient reduction and the buffers.

    None means: keep the master dtype (fp32). Batch-norm statistics stay fp32 whatever
    buffer_dtype says (torch FSDP's choice: they are unsafe in 16 bits).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    @classmethod
    def from_name(cls, name: str, *, reduce_dtype: str | None = None) -> MixedPrecision:
        """The preset `name` (bf16, fp16, fp32 or none): compute and float buffers in that
        dtype. `reduce_dtype` (bf16, fp16, fp32) overrides the preset's reduction dtype.

        Default reduction: bf16 under bf16, as in the paper's runs (section 4.4: the
        collectives run in the low precision too, halving their bytes, while the sharded
        master weights and the optimizer stay fp32); fp32 under fp16, whose narrow range
        overflows when gradients are summed over ranks. reduce_dtype="fp32" costs twice the
        reduce-scatter bytes and is bitwise what torch FSDP2 computes with
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32).
        """
        preset = from_short(name)
        if preset is None and name != "none":
            raise UsageError(f"unknown mixed precision {name!r}: use one of bf16, fp16, fp32, none")
        reduce_preset = from_short(reduce_dtype) if reduce_dtype is not None else None
        if reduce_dtype is not None and reduce_preset is None:
            raise UsageError(f"unknown reduce dtype {reduce_dtype!r}: use one of {', '.join(sorted(SHORT_NAMES))}")
        import torch

        dtype = None if preset is None or preset.torch is torch.float32 else preset.torch
        default_reduce = torch.float32 if dtype is torch.float16 else dtype
        reduce = reduce_preset.torch if reduce_preset is not None else default_reduce
        if reduce is torch.float32 and dtype is None:
            reduce = None  # fp32 everywhere: nothing to cast
        return cls(param_dtype=dtype, reduce_dtype=reduce, buffer_dtype=dtype)

    @property
    def enabled(self) -> bool:
        return self.param_dtype is not None


@dataclass(frozen=True)
class ShardingConfig:
    """How a model is sharded.

    strategy: full (FULL_SHARD), grad-op (SHARD_GRAD_OP), hybrid (HYBRID_SHARD), none (NO_SHARD);
    a Strategy or its string. shard_group_size: ranks a parameter is sharded over with `hybrid`.
    allgather_dtype: what the weight all-gather moves, the compute dtype or int8 in blocks of
    quant_block elements (engine/quant.py). bucket_bytes: consecutive units smaller than this
    are merged into one unit (engine/wrapping.py bucket_units); 0 merges none. The default, 1 MiB,
    is the smallest bucket that captured the measured gain on blocks of about 200 KB
    (docs/int8-and-bucketing.md); blocks above it stay one unit each. compile: each non-root
    unit's modules run their forward through torch.compile, the engine's hooks outside it.
    """

    strategy: Strategy = Strategy.FULL
    shard_group_size: int | None = None
    mixed_precision: MixedPrecision = MixedPrecision()
    backward_prefetch: BackwardPrefetch = BackwardPrefetch.PRE
    forward_prefetch: bool = False
    limit_all_gathers: int = 2
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    allgather_dtype: GatherDtype = GatherDtype.COMPUTE
    quant_block: int = 256
    bucket_bytes: int = 1024 * 1024
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "backward_prefetch", parse_enum(BackwardPrefetch, self.backward_prefetch, "backward prefetch"))
        object.__setattr__(self, "strategy", parse_enum(Strategy, self.strategy, "sharding strategy"))
        if self.limit_all_gathers < 0:
            raise UsageError(f"limit on in-flight all-gathers must be >= 0 (0: no limit), got {self.limit_all_gathers}")
        if self.strategy is Strategy.HYBRID and self.shard_group_size is None:
            raise UsageError("strategy 'hybrid' needs a shard group size (--shard-group-size)")
        if self.strategy is not Strategy.HYBRID and self.shard_group_size is not None:
            raise UsageError(f"--shard-group-size {self.shard_group_size} only applies to strategy 'hybrid', not '{self.strategy}'")
        if self.shard_group_size is not None and self.shard_group_size < 1:
            raise UsageError(f"shard group size must be >= 1, got {self.shard_group_size}")
        object.__setattr__(self, "allgather_dtype", parse_enum(GatherDtype, self.allgather_dtype, "all-gather dtype"))
        if self.quant_block < 1:
            raise UsageError(f"quantization block must be >= 1 element, got {self.quant_block}")
        if self.bucket_bytes < 0:
            raise UsageError(f"bucket bytes must be >= 0 (0: no bucketing), got {self.bucket_bytes}")
        if self.allgather_dtype is GatherDtype.INT8 and self.strategy == Strategy.NONE:
            raise UsageError("--allgather-dtype int8 needs a sharded strategy (full, grad-op or hybrid); 'none' gathers no weights")

    def validate_world_size(self, world_size: int) -> None:
        if world_size < 1:
            raise UsageError(f"world size must be >= 1, got {world_size}")
        group = self.shard_group_size  # never None under hybrid (__post_init__)
        if self.strategy is Strategy.HYBRID and group is not None and world_size % group:
            raise UsageError(f"world size {world_size} is not divisible by shard group size {self.shard_group_size}")

    def shard_factor(self, world_size: int) -> int:
        self.validate_world_size(world_size)
        if self.strategy is Strategy.HYBRID and self.shard_group_size is not None:
            return self.shard_group_size
        return 1 if self.strategy is Strategy.NONE else world_size

    @property
    def gather_block(self) -> int | None:
        """Elements per quantization block of the weight all-gather; None: no quantization."""
        return self.quant_block if self.allgather_dtype is GatherDtype.INT8 else None

    @property
    def reshard_after_forward(self) -> bool:
        return self.strategy in (Strategy.FULL, Strategy.HYBRID)
