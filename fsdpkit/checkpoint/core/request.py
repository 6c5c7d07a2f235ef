"""What `convert` was asked to write (ConvertRequest) and the check of its options against the
target format's `writes` (which options its writer takes and needs) and the source's `reads`
(the options its opener takes); what `reshard` was asked (ReshardRequest, its world size checked
when it is made). Pure data and checks: no reading of checkpoints, no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...errors import UsageError
from .bytecopy import DEFAULT_CHUNK_SIZE

# the options a writer or an opener may take, by ConvertRequest field, as the command line spells them
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


@dataclass(frozen=True)
class Options:
    """The options one side of a conversion takes: `needs` must be given, `takes` may be."""

    needs: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()
    why: str = ""  # appended to a message about these options


def check_options(source: str, reads: Options, writes: Options, request: ConvertRequest) -> None:
    """A UsageError naming the option and the source format unless every option given applies
    to the source's opener (`reads`) or the target's writer (`writes`), every one the writer
    needs is given and every count is positive."""
    why = f" ({writes.why})" if writes.why else ""
    allowed = (*writes.needs, *writes.takes, *reads.takes)
    for name in OPTION_FLAGS:
        if getattr(request, name) not in (None, False) and name not in allowed:
            takes = ", ".join(OPTION_FLAGS[n] for n in allowed)
            also = f"; it takes {takes}" if takes else ""
            raise UsageError(f"{OPTION_FLAGS[name]} does not apply to --to {request.to} from a {source} checkpoint{also}{why}")
    for name in writes.needs:
        if getattr(request, name) is None:
            raise UsageError(f"--to {request.to} from a {source} checkpoint needs {OPTION_FLAGS[name]}{why}")
    for name in ("world_size", "max_shard_size"):  # integer options that must be >= 1 when given
        check_count(name, getattr(request, name))


def check_count(name: str, value: int | None) -> None:
    """A UsageError naming the option unless `value` (a count such as the world size) is >= 1 or not given."""
    if value is not None and value < 1:
        raise UsageError(f"{OPTION_FLAGS[name]} must be >= 1, got {value}")


Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True)
class Keys:
    """A DCP checkpoint's top-level keys of the model and the optimizer state (None: found by
    themselves); other formats have no such keys."""

    model: str | None = None
    optimizer: str | None = None


@dataclass(frozen=True)
class ReshardRequest:
    """What `reshard` was asked to write: the new layout's ranks and how to copy."""

    world_size: int
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False
    progress: Progress | None = None
    warn: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        check_count("world_size", self.world_size)


def progress_callback(progress: Progress | None, total: int) -> Callable[[int], None] | None:
    """`progress` told the total now, as the byte engine's callback of bytes just done."""
    if progress is None:
        return None
    progress(0, total)
    return lambda done: progress(done, total)
