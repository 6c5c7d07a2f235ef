"""The training configuration: one frozen dataclass, validated before any process starts."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..engine.config import STRATEGIES, MixedPrecision, ShardingConfig
from ..errors import UsageError

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class TrainConfig:
    model: str = "gpt-tiny"
    vocab_size: int | None = None
    wrap: tuple[str, ...] = ()
    data: str = "synthetic"
    steps: int = 20
    global_batch_size: int = 8
    grad_accum: int = 1
    seq_len: int = 64
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    lr_decay_steps: int | None = None  # cosine horizon; None: --steps
    eval_every: int = 0
    eval_batches: int = 1
    metrics: str | None = None
    strategy: str = "full"
    shard_group_size: int | None = None
    mixed_precision: str = "none"
    device: str = "auto"
    wrap_min_params: int | None = None
    wrap_every: int = 1
    no_sync: bool = False
    max_grad_norm: float | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    deferred_init: bool | None = None  # None: on for built-in models, off for user factories
    backward_prefetch: str = "pre"
    forward_prefetch: bool = False
    limit_all_gathers: int = 2
    save_dir: str | None = None
    save_every: int = 0
    keep_last: int | None = None
    async_save: bool = False
    resume: str | None = None
    strict: bool = True
    init_from: str | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise UsageError(f"--steps must be >= 1, got {self.steps}")
        if self.global_batch_size < 1:
            raise UsageError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.grad_accum < 1:
            raise UsageError(f"--grad-accum must be >= 1, got {self.grad_accum}")
        if self.seq_len < 1:
            raise UsageError(f"--seq-len must be >= 1, got {self.seq_len}")
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if self.lr_schedule not in SCHEDULES:
            raise UsageError(f"unknown --lr-schedule {self.lr_schedule!r}: use one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            raise UsageError(f"--lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"--betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0 or self.eval_every < 0 or self.eval_batches < 1:
            raise UsageError(f"--warmup-steps and --eval-every must be >= 0 (got {self.warmup_steps}, {self.eval_every})")
        if self.strategy not in STRATEGIES:
            raise UsageError(f"unknown --strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"unknown --device {self.device!r}: use auto, cpu or cuda")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise UsageError(f"--lr-decay-steps must be >= 1, got {self.lr_decay_steps}")
        if self.save_every < 0:
            raise UsageError(f"--save-every must be >= 0, got {self.save_every}")
        if self.keep_last is not None and self.keep_last < 1:
            raise UsageError(f"--keep-last must be >= 1, got {self.keep_last}")
        if (self.save_every or self.keep_last or self.async_save) and not self.save_dir:
            raise UsageError("--save-every, --keep-last and --async-save need --save-dir")
        if self.resume and self.init_from:
            raise UsageError("--resume and --init-from exclude each other: resume continues a run, init-from starts one from weights")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise UsageError(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        if self.no_sync and self.grad_accum == 1:
            raise UsageError("--no-sync accumulates gradients over micro-batches: it needs --grad-accum > 1")
        self.sharding  # validates strategy / group size / mixed precision / overlap settings

    @property
    def sharding(self) -> ShardingConfig:
        return ShardingConfig(
            strategy=self.strategy,
            shard_group_size=self.shard_group_size,
            mixed_precision=MixedPrecision.from_name(self.mixed_precision),
            backward_prefetch=self.backward_prefetch,
            forward_prefetch=self.forward_prefetch,
            limit_all_gathers=self.limit_all_gathers,
            cpu_offload=self.cpu_offload,
            activation_checkpointing=self.activation_checkpointing,
        )

    def validate_world_size(self, world_size: int) -> None:
        self.sharding.validate_world_size(world_size)
        if self.global_batch_size % (world_size * self.grad_accum):
            raise UsageError(
                f"--global-batch-size {self.global_batch_size} is not divisible by world size {world_size}"
                f" x --grad-accum {self.grad_accum} = {world_size * self.grad_accum}"
            )

    @property
    def schedule_steps(self) -> int:
        return self.lr_decay_steps or self.steps

    def micro_batch_size(self, world_size: int) -> int:
        return self.global_batch_size // (world_size * self.grad_accum)

    def to_json(self) -> dict:
        return asdict(self)
