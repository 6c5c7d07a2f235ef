"""Which `convert` options apply to which source format and target: one row per (source, target).

Pure data and one check, no reading of checkpoints, no torch. A source is named as
formats.FORMATS names it. Each route names the function that converts (`module:function`,
called as `function(src, dst, request, progress)`, imported only when it runs); adding an
option is one field of ConvertRequest and one entry of OPTION_FLAGS.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import UsageError
from ..format.bytecopy import DEFAULT_CHUNK_SIZE
from .formats import DCP, DEEPSPEED, FULL, SHARDED, TARGETS, TORCH_SAVE

# the options a route may take or need, by ConvertRequest field, as the command line spells them
OPTION_FLAGS = {
    "world_size": "--world-size",
    "model": "--model",
    "max_shard_size": "--max-shard-size",
    "cast_to": "--dtype",
    "with_optimizer": "--with-optimizer",
    "model_key": "--dcp-model-key",
    "optimizer_key": "--dcp-optimizer-key",
    "stage": "--stage",
}
POSITIVE = ("world_size", "max_shard_size")  # integer options that must be >= 1 when given


@dataclass(frozen=True)
class ConvertRequest:
    """What `convert` was asked to write; an option not given is None (False for a switch)."""

    to: str
    world_size: int | None = None
    model: str | None = None  # a model spec as `--model` takes it
    max_shard_size: int | None = None  # bytes
    cast_to: str | None = None  # "F32", "F16", "BF16"
    with_optimizer: bool = False
    model_key: str | None = None
    optimizer_key: str | None = None
    stage: int | None = None  # DeepSpeed ZeRO stage
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False

    def given(self) -> list[str]:
        """The table's options that were given, in OPTION_FLAGS' order."""
        return [name for name in OPTION_FLAGS if getattr(self, name) not in (None, False)]


@dataclass(frozen=True)
class Route:
    converter: str  # "module:function", called as function(src, dst, request, progress) -> result dict
    required: tuple[str, ...] = ()  # ConvertRequest fields that must be given
    optional: tuple[str, ...] = ()  # fields that may be given; any other given one is an error
    why: str = ""  # appended to a message about this route's options


_CONVERTERS = "fsdpkit.checkpoint.offline.converters"
_FULL_OUTPUT = ("max_shard_size", "cast_to", "with_optimizer")
_DCP_KEYS = ("model_key", "optimizer_key")
_DCP_OUTPUT_WHY = "the optimizer state, when there is one, goes with it"

ROUTES: dict[tuple[str, str], Route] = {
    (SHARDED, "full"): Route(f"{_CONVERTERS}:sharded_to_full", optional=_FULL_OUTPUT),
    (FULL, "sharded"): Route(f"{_CONVERTERS}:full_to_sharded", required=("world_size",), optional=("model", "cast_to", "with_optimizer")),
    (SHARDED, "dcp"): Route(f"{_CONVERTERS}:sharded_to_dcp", optional=("world_size",), why=_DCP_OUTPUT_WHY),
    (FULL, "dcp"): Route(f"{_CONVERTERS}:full_to_dcp", optional=("world_size",), why=_DCP_OUTPUT_WHY),
    (DCP, "full"): Route(f"{_CONVERTERS}:dcp_to_full", optional=("model", *_FULL_OUTPUT, *_DCP_KEYS)),
    (DCP, "sharded"): Route(
        f"{_CONVERTERS}:dcp_to_sharded",
        required=("world_size", "model"),
        optional=("with_optimizer", *_DCP_KEYS),
        why="--model names the model whose flat-parameter layout to write; the optimizer state goes with it",
    ),
    (DEEPSPEED, "full"): Route(f"{_CONVERTERS}:deepspeed_to_full", optional=("model", *_FULL_OUTPUT)),
    (DEEPSPEED, "sharded"): Route(
        f"{_CONVERTERS}:deepspeed_to_sharded",
        required=("world_size", "model"),
        why="--model names the model whose flat-parameter layout to write; the optimizer state goes with it",
    ),
    (DEEPSPEED, "dcp"): Route(f"{_CONVERTERS}:deepspeed_to_dcp", optional=("world_size",), why=_DCP_OUTPUT_WHY),
    (TORCH_SAVE, "full"): Route(f"{_CONVERTERS}:torchsave_to_full", optional=("model", *_FULL_OUTPUT)),
    (TORCH_SAVE, "sharded"): Route(
        f"{_CONVERTERS}:torchsave_to_sharded",
        required=("world_size", "model"),
        why="--model names the model whose flat-parameter layout to write; the optimizer state goes with it",
    ),
    (TORCH_SAVE, "deepspeed"): Route(
        f"{_CONVERTERS}:torchsave_to_deepspeed",
        required=("stage",),
        optional=("world_size",),
        why="DeepSpeed's ZeRO stage and ranks (default: the files') to lay the fp32 weights and AdamW state out for",
    ),
    (TORCH_SAVE, "dcp"): Route(f"{_CONVERTERS}:torchsave_to_dcp", optional=("world_size",), why=_DCP_OUTPUT_WHY),
    (DCP, "dcp"): Route(f"{_CONVERTERS}:dcp_to_dcp", optional=("world_size",), why=_DCP_OUTPUT_WHY),
    **{
        (source, "deepspeed"): Route(
            f"{_CONVERTERS}:safetensors_to_deepspeed",
            required=("stage",),
            optional=("world_size",),
            why="DeepSpeed's ZeRO stage and ranks (default: the source's) to lay the fp32 weights and AdamW state out for",
        )
        for source in (SHARDED, FULL)
    },
    (DCP, "deepspeed"): Route(
        f"{_CONVERTERS}:dcp_to_deepspeed",
        required=("stage", "world_size"),
        optional=_DCP_KEYS,
        why="DeepSpeed's ZeRO stage and ranks to lay the fp32 weights and AdamW state out for",
    ),
}


def route_for(source: str, request: ConvertRequest) -> Route:
    """The route from `source` to `request.to`, after checking that every option given applies
    to it, every option it needs is given and every count is positive; a UsageError naming the
    option and the source format otherwise."""
    if request.to not in TARGETS:
        raise UsageError(f"unknown --to {request.to!r}: use {', '.join(TARGETS[:-1])} or {TARGETS[-1]}")
    route = ROUTES.get((source, request.to))
    if route is None:
        reachable = [target for (known, target) in ROUTES if known == source]
        same = "; `fsdpkit reshard` lays it out for another world size" if source == request.to else ""
        raise UsageError(f"a {source} checkpoint cannot be converted --to {request.to}: use --to {' or '.join(reachable)}{same}")
    why = f" ({route.why})" if route.why else ""
    for name in request.given():
        if name not in route.required and name not in route.optional:
            takes = [OPTION_FLAGS[n] for n in (*route.required, *route.optional)]
            also = f"; it takes {', '.join(takes)}" if takes else ""
            raise UsageError(f"{OPTION_FLAGS[name]} does not apply to --to {request.to} from a {source} checkpoint{also}{why}")
    for name in route.required:
        if getattr(request, name) is None:
            raise UsageError(f"--to {request.to} from a {source} checkpoint needs {OPTION_FLAGS[name]}{why}")
    for name in POSITIVE:
        value = getattr(request, name)
        if value is not None and value < 1:
            raise UsageError(f"{OPTION_FLAGS[name]} must be >= 1, got {value}")
    return route
