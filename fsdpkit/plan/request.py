"""What the planner is asked: a run's model, sharding, optimizer and batch at a world size.
The CLI builds one from its options (`TrainConfig.plan_request` from a training config); the
planner never reads the training app's configuration."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.config import ShardingConfig
from ..engine.step_policy import StepPolicy
from ..errors import UsageError
from ..models.recipe import Optimizer
from .kernels import OptimizerKernel

KNOWN_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.SGD)


@dataclass(frozen=True)
class PlanRequest:
    """A run to plan. `wrap`, `wrap_min_params` and `wrap_every` choose its units as
    `fsdpkit train` does (models.units.wrap_policy)."""

    model: str
    world_size: int
    sharding: ShardingConfig
    optimizer: Optimizer = Optimizer.ADAMW
    seq_len: int = 64
    global_batch_size: int = 8
    grad_accum: int = 1
    no_sync: bool = False
    wrap: tuple[str, ...] = ()
    wrap_min_params: int | None = None
    wrap_every: int = 1
    # None: what `fsdpkit train` runs (fused on a device of its own per rank, without CPU offload)
    optimizer_kernel: OptimizerKernel | None = None

    def __post_init__(self) -> None:
        if self.optimizer not in KNOWN_OPTIMIZERS:
            raise UsageError(f"the planner does not know the state of optimizer {self.optimizer!r}")
        self.sharding.shard_factor(self.world_size)  # validates the world size against the strategy

    @property
    def cpu_offload(self) -> bool:
        return self.sharding.cpu_offload

    @property
    def policy(self) -> StepPolicy:
        return StepPolicy.of(self.sharding)

    @property
    def units_key(self) -> tuple:
        """What the meta model's units and their work depend on (not the world size or strategy)."""
        return (self.model, self.wrap, self.wrap_min_params, self.wrap_every, self.sharding.bucket_bytes, self.seq_len)

    @property
    def micro_batch(self) -> int:
        """Sequences per rank and micro-batch: global batch / (world size x grad accum)."""
        ranks_and_micro = self.world_size * self.grad_accum
        if self.global_batch_size % ranks_and_micro:
            raise UsageError(
                f"--global-batch-size {self.global_batch_size} is not divisible by world size {self.world_size}"
                f" x --grad-accum {self.grad_accum} = {ranks_and_micro}"
            )
        return self.global_batch_size // ranks_and_micro
