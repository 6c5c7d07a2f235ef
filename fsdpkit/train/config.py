"""The training configuration: a tree of frozen dataclasses, validated at construction.

    TrainConfig(steps, seed, device,
                model, data, sharding (the engine's ShardingConfig, passed whole to
                fsdpkit.shard), optimizer, checkpoint, logging, launch)

Every field is a setting (fsdpkit.settings): it carries its own help text and flag, so the
command line, `--config run.toml` and `--print-config` are all derived from the fields below.
Checks that need the world size are in `check_world_size`, called once before training starts.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.storage.location import is_url
from ..data.tokens import TokenDtype
from ..dist.launch import LaunchOptions
from ..engine.config import BACKWARD_PREFETCH, GATHER_DTYPES, STRATEGIES, ShardingConfig
from ..errors import UsageError
from ..models.recipe import PRECISIONS, REDUCE_DTYPES, Optimizer, precision_names, precision_policy
from ..models.registry import DEFAULT_MODEL, MODEL_HELP, default_lr, default_warmup_steps
from ..plan.request import PlanRequest
from ..settings import Section, Setting, setting, settings_of


class Device(enum.StrEnum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class LrSchedule(enum.StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"


def parse_pair(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2:
        raise UsageError(f"--betas {text!r} must be two numbers separated by a comma, e.g. 0.9,0.95")
    return values[0], values[1]


def _at_least(value: int | float | None, minimum: int | float, flag: str) -> None:
    if value is not None and value < minimum:
        raise UsageError(f"{flag} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    name: str = setting(DEFAULT_MODEL, MODEL_HELP, flag="--model", metavar="NAME")
    vocab_size: int | None = setting(None, "Vocabulary size, if the model has no vocab_size attribute.")
    wrap: tuple[str, ...] = setting(
        (),
        "package.module:ClassName whose instances are units (repeatable); "
        "default: each transformer block (a transformers model's _no_split_modules), "
        "or each element of every nn.ModuleList.",
        metavar="CLASS",
    )
    wrap_min_params: int | None = setting(
        None, "Also make a unit of every module holding at least N parameters not already in a nested unit."
    )
    wrap_every: int = setting(1, "K consecutive blocks per unit.")
    deferred_init: bool | None = setting(
        None,
        "Build on the meta device and materialise one unit at a time (default: on for built-in and hf: models).",
        panel="Memory",
        off_flag="--eager-init",
    )

    def __post_init__(self) -> None:
        _at_least(self.vocab_size, 1, "--vocab-size")
        _at_least(self.wrap_min_params, 1, "--wrap-min-params")
        _at_least(self.wrap_every, 1, "--wrap-every")


@dataclass(frozen=True)
class DataConfig:
    source: str = setting(
        "synthetic",
        "'synthetic' (seeded, learnable); a .bin file of tokens (nanoGPT-style, "
        "memory-mapped; fsdpkit prepare-data writes one); a text file; or documents: .jsonl/.json (one per line), "
        ".parquet (a file, directory or glob of shards), a datasets save_to_disk directory or a Hub dataset name in the "
        "local cache ([data] extra), packed into --seq-len windows with an end-of-text token between documents. "
        "Text is tokenised by the model's tokenizer (hf:DIR with one) or read as bytes. 90% train, 10% held out.",
        flag="--data",
        metavar="SOURCE",
    )
    text_field: str = setting("text", "The field that holds each document's text (jsonl, parquet, datasets).")
    eval_data: str | None = setting(
        None, "Held-out data, any source --data takes (default: the last 10% of --data's tokens).", metavar="SOURCE"
    )
    streaming: bool = setting(
        False,
        "Read documents shard by shard, each rank only its own shards (at least one per rank), memory not growing "
        "with the dataset; the global batch then depends on the world size, and a resume keeps it.",
        flag="--data-streaming",
    )
    token_dtype: TokenDtype = setting(TokenDtype.UINT16, "Element type of a .bin token file.")
    seq_len: int = setting(64, "Tokens per sequence.")
    global_batch_size: int = setting(8, "Sequences per optimizer step, over all ranks and micro-batches.")
    grad_accum: int = setting(1, "Micro-batches per optimizer step.")
    no_sync: bool = setting(
        False, "With --grad-accum: accumulate unsharded gradients locally and reduce once, on the last micro-batch.", panel="Memory"
    )
    eval_every: int = setting(0, "Held-out loss every N steps (0: never).")
    eval_batches: int = setting(1, "Held-out global batches per evaluation.")

    def __post_init__(self) -> None:
        for flag, value in (
            ("--seq-len", self.seq_len),
            ("--global-batch-size", self.global_batch_size),
            ("--grad-accum", self.grad_accum),
            ("--eval-batches", self.eval_batches),
        ):
            _at_least(value, 1, flag)
        _at_least(self.eval_every, 0, "--eval-every")
        if self.streaming and self.eval_every and not self.eval_data:
            raise UsageError("--eval-every with --data-streaming needs --eval-data (a streamed dataset is not split)")
        if self.no_sync and self.grad_accum == 1:
            raise UsageError("--no-sync accumulates gradients over micro-batches: it needs --grad-accum > 1")


@dataclass(frozen=True)
class OptimizerConfig:
    name: Optimizer = setting(Optimizer.ADAMW, "The optimizer.", flag="--optimizer")
    lr: float | None = setting(
        None,
        "Peak learning rate (0: the weights do not move). Default: the model's: gpt-tiny 3e-3, gpt-small 1e-3, "
        "gpt2 6e-4, gpt2-medium 3e-4, gpt2-large 2.5e-4, gpt2-xl 2e-4 (the GPT-3 paper's for their sizes), others 3e-3.",
    )
    weight_decay: float = setting(0.1, "Weight decay on matrices and embeddings (not on biases or norms).")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas, two numbers: 0.9,0.95.", parse=parse_pair, metavar="B1,B2")
    momentum: float = setting(0.0, "SGD momentum (0: plain SGD).")
    nesterov: bool = setting(False, "SGD with Nesterov momentum (needs --momentum > 0).")
    max_grad_norm: float | None = setting(None, "Clip the global gradient norm to this value.")
    schedule: LrSchedule = setting(LrSchedule.CONSTANT, "Learning rate after the warm-up.", flag="--lr-schedule")
    warmup_steps: int | None = setting(None, "Linear warm-up steps. Default: the model's: 10 for the GPT-2 sizes, 0 for the others.")
    decay_steps: int | None = setting(
        None, "Steps the cosine schedule decays over (default: --steps; set it to extend a run exactly).", flag="--lr-decay-steps"
    )

    def __post_init__(self) -> None:
        if self.lr is not None and not 0 <= self.lr < math.inf:  # 0: a run that must not move the weights
            raise UsageError(f"--lr must be a finite number >= 0, got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise UsageError(f"--weight-decay must be a finite number >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < math.inf:
            raise UsageError(f"--momentum must be a finite number >= 0, got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise UsageError("--nesterov needs --momentum > 0")
        if (self.momentum or self.nesterov) and self.name is not Optimizer.SGD:
            raise UsageError(f"--momentum and --nesterov are settings of --optimizer sgd, not {self.name.value}")
        if not all(0 <= b < 1 for b in self.betas):
            raise UsageError(f"--betas must be two numbers in [0, 1), got {','.join(map(str, self.betas))}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise UsageError(f"--max-grad-norm must be > 0, got {self.max_grad_norm}")
        _at_least(self.warmup_steps, 0, "--warmup-steps")
        _at_least(self.decay_steps, 1, "--lr-decay-steps")


@dataclass(frozen=True)
class CheckpointConfig:
    save_dir: str | None = setting(
        None,
        "Run directory for sharded checkpoints (step-NNNNNNNN/ and latest); on several nodes, a filesystem every node sees.",
        metavar="DIR",
    )
    save_every: int = setting(0, "Save every N steps (0: only at the end).")
    keep_last: int | None = setting(None, "Keep only the newest K complete checkpoints.")
    async_save: bool = setting(
        False, "Copy each save into reused host memory, then write it from a background thread (lower priority) while training goes on."
    )
    resume: str | None = setting(
        None,
        "Continue the run in a run directory (its latest) or a step-* directory, at any world size: its saved settings are "
        "the defaults, and a flag that changes one says so. A torch DCP, DeepSpeed ZeRO or full safetensors checkpoint is "
        "converted for this run's world size first (optimizer state included when it holds one; --model names its model).",
        metavar="DIR",
    )
    strict: bool = setting(True, "Missing optimizer state in --resume is an error (--no-strict: start it fresh).")
    new_run: bool = setting(
        False, "Start a new run in a --save-dir that holds another run's checkpoints (they move to DIR/earlier-<time>/)."
    )
    init_from: str | None = setting(
        None,
        "Start from the weights of a full safetensors or a sharded checkpoint, or of a torch DCP or DeepSpeed ZeRO one "
        "(converted for this run's world size first; --model names its model).",
        metavar="PATH",
    )
    snapshot_every: int = setting(
        10,
        "With --max-restarts: every N steps, copy each rank's part of a checkpoint into shared memory (/dev/shm, two slots), "
        "in the background; a restart resumes from there when it is newer than the disk checkpoint (0: never).",
    )

    def __post_init__(self) -> None:
        _at_least(self.save_every, 0, "--save-every")
        _at_least(self.snapshot_every, 0, "--snapshot-every")
        _at_least(self.keep_last, 1, "--keep-last")
        if (self.save_every or self.keep_last or self.async_save or self.new_run) and not self.save_dir:
            raise UsageError("--save-every, --keep-last, --async-save and --new-run need --save-dir")
        if self.resume and self.init_from:
            raise UsageError("--resume and --init-from exclude each other: resume continues a run, init-from starts one from weights")
        if self.new_run and self.save_dir and is_url(self.save_dir):
            raise UsageError(
                f"--new-run --save-dir {self.save_dir}: an object store cannot set the earlier checkpoints aside; "
                "give the new run a prefix of its own"
            )


@dataclass(frozen=True)
class LoggingConfig:
    metrics: str | None = setting(None, "Append one JSON line per step to this file (fsdpkit report draws it).", metavar="FILE")
    tensorboard: str | None = setting(
        None, "Also write the same scalars as TensorBoard event files into this directory (needs the [tensorboard] extra).", metavar="DIR"
    )
    wandb: str | None = setting(
        None,
        "Also log the config and every step to Weights & Biases, project PROJECT, run name RUN ([wandb] extra; "
        "WANDB_MODE=offline needs no network).",
        metavar="PROJECT[/RUN]",
    )
    mlflow: bool = setting(
        False,
        "Also log the config and every step to MLflow ([mlflow] extra), at --mlflow-uri, else $MLFLOW_TRACKING_URI, "
        "else a local mlruns/ directory.",
    )
    mlflow_uri: str | None = setting(
        None, "With --mlflow: the tracking URI (a directory such as mlruns: local files; http://host:5000: a server).", metavar="URI"
    )
    log_every: int = setting(10, "Without a terminal on stderr: a progress line every N steps or --log-seconds, whichever comes first.")
    log_seconds: float = setting(
        30.0, "Without a terminal on stderr: a progress line every S seconds or --log-every steps (a terminal gets a bar)."
    )
    quiet: bool = setting(False, "No progress bar or progress lines (errors and the summary only).")

    def __post_init__(self) -> None:
        _at_least(self.log_every, 1, "--log-every")
        if not self.log_seconds > 0:
            raise UsageError(f"--log-seconds must be > 0, got {self.log_seconds}")
        if self.mlflow_uri and not self.mlflow:
            raise UsageError(f"--mlflow-uri {self.mlflow_uri!r} is where --mlflow logs: give --mlflow too")


# The engine's ShardingConfig is a section as it is; only mixed precision is given by name
# (plus an optional reduction dtype) instead of as a MixedPrecision of torch dtypes.
_SHARDING_DEFAULT = ShardingConfig()


def _build_sharding(*, mixed_precision: str = "none", reduce_dtype: str | None = None, **fields: Any) -> ShardingConfig:
    checked = ShardingConfig(**fields)  # every other field is checked before the dtypes import torch
    return dataclasses.replace(checked, mixed_precision=precision_policy(mixed_precision, reduce_dtype))


def _sharding_values(config: ShardingConfig) -> dict[str, Any]:
    name, reduce_dtype = precision_names(config.mixed_precision)
    by_name = {"mixed_precision": name, "reduce_dtype": reduce_dtype}
    return {s.key: by_name[s.key] if s.key in by_name else getattr(config, s.key) for s in SHARDING_SETTINGS}


def _engine_setting(key: str, kind: Any, help: str, panel: str, **options: Any) -> Setting:
    return Setting(key=key, type=kind, default=getattr(_SHARDING_DEFAULT, key), help=help, panel=panel, **options)


SHARDING_SETTINGS = (
    _engine_setting(
        "strategy",
        str,
        "full (FULL_SHARD), grad-op (SHARD_GRAD_OP, ZeRO-2), hybrid (HYBRID_SHARD: "
        "shard in groups of --shard-group-size ranks, replicate across) or none (NO_SHARD, like DDP).",
        "Sharding",
        choices=tuple(STRATEGIES),
    ),
    _engine_setting("shard_group_size", int | None, "Ranks per shard group with --strategy hybrid.", "Sharding"),
    Setting(
        key="mixed_precision",
        type=str,
        default="none",
        panel="Precision",
        choices=PRECISIONS,
        help="Unsharded parameters and gradients in this dtype; fp32 sharded master weights (fp16 adds a sharded gradient scaler).",
    ),
    Setting(
        key="reduce_dtype",
        type=str | None,
        default=None,
        panel="Precision",
        choices=REDUCE_DTYPES,
        help="Reduce gradients in this dtype (default: bf16 with bf16, fp32 with fp16).",
    ),
    _engine_setting(
        "cpu_offload", bool, "Keep sharded parameters, gradients and optimizer state in host memory; the optimizer steps there.", "Memory"
    ),
    _engine_setting("activation_checkpointing", bool, "Recompute each unit's activations in backward.", "Memory"),
    _engine_setting(
        "compile",
        bool,
        "torch.compile each transformer block (each unit's forward; the engine's gathers and reductions stay outside). "
        "The first steps take longer while it compiles; needs a C compiler on CPU.",
        "Overlap",
    ),
    _engine_setting(
        "backward_prefetch",
        str,
        "When the next unit's all-gather is issued in backward: before "
        "(pre) or after (post) the current reduce-scatter, or not early (none).",
        "Overlap",
        choices=tuple(str(p) for p in BACKWARD_PREFETCH),
    ),
    _engine_setting("forward_prefetch", bool, "Issue the next unit's all-gather before the current unit's forward.", "Overlap"),
    _engine_setting("limit_all_gathers", int, "Most all-gathers in flight (0: no limit).", "Overlap"),
    _engine_setting(
        "allgather_dtype",
        str,
        "What the weight all-gather moves: the compute dtype, or int8 in blocks of --quant-block "
        "elements with one fp32 scale each (the unit computes with the dequantized weights).",
        "Communication",
        choices=tuple(str(d) for d in GATHER_DTYPES),
    ),
    _engine_setting("quant_block", int, "Elements per quantization block with --allgather-dtype int8.", "Communication"),
    _engine_setting(
        "bucket_bytes",
        int,
        "Consecutive units each smaller than this many bytes (master dtype) are gathered and reduced together, as one unit "
        "of up to this size: fewer collectives for small blocks (0: never; one unit per wrapped module).",
        "Communication",
    ),
)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(20, "The step count the run ends at (a resumed run continues up to it).", panel="Optimizer")
    seed: int = setting(0, "Seed for the weights and the data.", panel="Data")
    device: Device = setting(Device.AUTO, "auto: CUDA with NCCL when there is a GPU, else CPU with gloo.", panel="Launch")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchOptions = field(default_factory=LaunchOptions)

    def __post_init__(self) -> None:
        _at_least(self.steps, 1, "--steps")
        # the model's defaults are written into the config: a saved run records the values it used
        resolved = dataclasses.replace(self.optimizer, lr=self.peak_lr, warmup_steps=self.warmup_steps)
        object.__setattr__(self, "optimizer", resolved)

    @property
    def schedule_steps(self) -> int:
        """The cosine schedule's horizon."""
        return self.optimizer.decay_steps or self.steps

    @property
    def peak_lr(self) -> float:
        """--lr, else the model's default."""
        return self.optimizer.lr if self.optimizer.lr is not None else default_lr(self.model.name)

    @property
    def warmup_steps(self) -> int:
        """--warmup-steps, else the model's default."""
        return self.optimizer.warmup_steps if self.optimizer.warmup_steps is not None else default_warmup_steps(self.model.name)

    @property
    def tokens_per_step(self) -> int:
        return self.data.global_batch_size * self.data.seq_len

    def plan_request(self, world_size: int) -> PlanRequest:
        """What `fsdpkit plan` is asked of this run on `world_size` ranks."""
        model, data = self.model, self.data
        return PlanRequest(
            model=model.name,
            world_size=world_size,
            sharding=self.sharding,
            optimizer=self.optimizer.name,
            seq_len=data.seq_len,
            global_batch_size=data.global_batch_size,
            grad_accum=data.grad_accum,
            no_sync=data.no_sync,
            wrap=model.wrap,
            wrap_min_params=model.wrap_min_params,
            wrap_every=model.wrap_every,
        )

    def check_world_size(self, world_size: int) -> None:
        """Everything that depends on the number of ranks; called once, before training."""
        self.sharding.validate_world_size(world_size)
        ranks_and_micro = world_size * self.data.grad_accum
        if self.data.global_batch_size % ranks_and_micro:
            raise UsageError(
                f"--global-batch-size {self.data.global_batch_size} is not divisible by world size {world_size}"
                f" x --grad-accum {self.data.grad_accum} = {ranks_and_micro}"
            )

    @classmethod
    def from_values(cls, values: Mapping[str, Any], *, where: str = "") -> TrainConfig:
        """From plain values nested as in a config file: {"steps": 10, "optimizer": {"lr": 1e-3}}.
        Absent keys take their defaults; an unknown key is a UsageError naming it (and `where`)."""
        sections = {section.name: section for section in SECTIONS}
        top = {}
        for key, value in values.items():
            if isinstance(value, Mapping) and key in sections:
                continue
            if key in sections:
                keys = ", ".join(s.key for s in sections[key].settings)
                raise UsageError(f"setting {key!r}{where} is a section: write [{key}] with keys {keys}")
            top[key] = value
        settings = TOP.from_values(top, where=where)
        # the sharding section builds torch dtypes: every other setting is checked first, without torch
        order = sorted(sections, key=lambda name: name == "sharding")
        built = {name: sections[name].from_values(values.get(name, {}), where=where) for name in order}
        return cls(**settings, **built)

    def to_values(self) -> dict[str, Any]:
        """The inverse of from_values: plain values a config file holds."""
        return {**TOP.plain_values(self), **{s.name: s.plain_values(getattr(self, s.name)) for s in SECTIONS}}


def _top_settings(**values: Any) -> dict[str, Any]:
    """The top-level settings as given, --steps checked now (TrainConfig checks it again): a bad
    value is named before the sharding section imports torch."""
    if "steps" in values:
        _at_least(values["steps"], 1, "--steps")
    return values


TOP: Section = Section(
    "", "", settings_of(TrainConfig), _top_settings, lambda config: {s.key: getattr(config, s.key) for s in TOP.settings}
)
SECTIONS = (
    Section.of("model", ModelConfig, panel="Model"),
    Section.of("data", DataConfig, panel="Data"),
    Section("sharding", "Sharding", SHARDING_SETTINGS, _build_sharding, _sharding_values),
    Section.of("optimizer", OptimizerConfig, panel="Optimizer"),
    Section.of("checkpoint", CheckpointConfig, panel="Checkpoints"),
    Section.of("logging", LoggingConfig, panel="Output"),
    Section.of("launch", LaunchOptions, panel="Launch"),
)
