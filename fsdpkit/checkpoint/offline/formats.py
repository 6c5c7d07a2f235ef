"""Every checkpoint format fsdpkit reads, by its one name (the one `convert --to`, the `--json`
reports and `open_checkpoint(...).format` use): FORMATS, one row per format. `detect_format` is
the only place that tells a format; `convert` is `FORMATS[to].write(open(src))`, and `inspect`,
`verify` and `reshard` go through the row too. Adding a format is its package and one row here.
Reading the table imports no torch: the offline side of every format is pure Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ..dcp.export import DcpOutput, reshard_dcp, sources_to_dcp
from ..dcp.inspect import summarize_dcp, verify_dcp
from ..dcp.metadata import is_dcp_checkpoint
from ..deepspeed.files import is_deepspeed_checkpoint
from ..deepspeed.inspect import summarize_deepspeed, verify_deepspeed
from ..format.names import LATEST_NAME, MANIFEST_NAME, parse_step_dir_name
from ..format.reader import is_full_checkpoint
from ..format.report import VerifyReport, WriteReport
from ..format.summary import Summary
from ..torchsave.inspect import summarize_torchsave, verify_torchsave
from ..torchsave.table import is_torchsave_checkpoint
from .any_checkpoint import (
    AnyCheckpoint,
    open_dcp_checkpoint,
    open_deepspeed_checkpoint,
    open_full_checkpoint,
    open_sharded_checkpoint,
    open_torchsave_checkpoint,
)
from .convert import reshard, to_full
from .locations import local_only
from .request import ConvertRequest, Keys, Options, Progress, ReshardRequest, check_options
from .to_deepspeed import reshard_deepspeed, to_deepspeed
from .to_sharded import to_sharded
from .verify import summarize, summarize_full, verify_checkpoint, verify_full

SHARDED, DCP, DEEPSPEED, TORCH_SAVE, FULL = "sharded", "dcp", "deepspeed", "torch-save-ranks", "full"


@dataclass(frozen=True)
class Format:
    name: str
    label: str  # how help and messages name it
    detect: Callable[[Path], bool]
    open: Callable[[Path, Keys], AnyCheckpoint]
    inspect: Callable[[Path, Keys], Summary]  # the summary `inspect` prints
    verify: Callable[[Path, Progress | None], VerifyReport]  # every check the format allows
    reshard: Callable[[Path, Path, ReshardRequest], dict] | None  # None: a format without ranks to lay out
    write: Callable[[AnyCheckpoint, Path, ConvertRequest, Progress | None], dict] | None  # `convert --to` it; None: not written
    writes: Options = Options()  # the options `write` takes
    reads: Options = Options()  # the options `open` takes


def _is_sharded(path: Path) -> bool:
    """A step directory (its manifest), or a run directory (`latest`, or step-* directories)."""
    if not path.is_dir():
        return False
    if (path / MANIFEST_NAME).exists() or (path / LATEST_NAME).exists():
        return True
    return any(parse_step_dir_name(child.name) is not None for child in path.iterdir())


def _write_dcp(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> dict:
    """FSDP2's `{"model", "optimizer"}` layout chunked for `--world-size` ranks (default 1): the
    model (tied names too, as FSDP2's state dict holds them), the optimizer state and its param groups."""
    output = DcpOutput(request.world_size or 1, request.chunk_size, request.overwrite)
    return sources_to_dcp(opened.stored(), Path(opened.opened_from), dst, aliases=opened.aliases, groups=opened.groups, output=output)


# In the order messages list them. A DeepSpeed save directory has a `latest` as fsdpkit's run
# directory does: `detect_format` tries fsdpkit's own format last.
FORMATS: dict[str, Format] = {
    SHARDED: Format(
        SHARDED,
        "fsdpkit",
        _is_sharded,
        lambda path, keys: open_sharded_checkpoint(path),
        lambda path, keys: summarize(path),
        verify_checkpoint,
        lambda src, dst, r: reshard(
            src, dst, world_size=r.world_size, chunk_size=r.chunk_size, overwrite=r.overwrite, progress=r.progress, warn=r.warn
        ),
        to_sharded,
        Options(
            needs=("world_size",),
            takes=("model", "cast_to", "with_optimizer"),
            why="--model names the model whose flat-parameter layout to write, default an even split per tensor;"
            " the optimizer state goes with it",
        ),
    ),
    DCP: Format(
        DCP,
        "DCP",
        is_dcp_checkpoint,
        open_dcp_checkpoint,
        lambda path, keys: summarize_dcp(path, model_key=keys.model, optimizer_key=keys.optimizer),
        lambda path, progress: verify_dcp(path),
        lambda src, dst, r: reshard_dcp(src, dst, world_size=r.world_size, chunk_size=r.chunk_size, overwrite=r.overwrite),
        _write_dcp,
        Options(takes=("world_size",), why="the optimizer state, when there is one, goes with it"),
        reads=Options(takes=("model_key", "optimizer_key")),
    ),
    DEEPSPEED: Format(
        DEEPSPEED,
        "DeepSpeed",
        is_deepspeed_checkpoint,
        lambda path, keys: open_deepspeed_checkpoint(path),
        lambda path, keys: summarize_deepspeed(path),
        lambda path, progress: verify_deepspeed(path),
        lambda src, dst, r: reshard_deepspeed(src, dst, world_size=r.world_size, overwrite=r.overwrite, progress=r.progress),
        to_deepspeed,
        Options(
            needs=("stage",),
            takes=("world_size",),
            why="DeepSpeed's ZeRO stage and ranks (default: the source's) to lay the fp32 weights and AdamW state out for",
        ),
    ),
    TORCH_SAVE: Format(
        TORCH_SAVE,
        "verl",
        is_torchsave_checkpoint,
        lambda path, keys: open_torchsave_checkpoint(path),
        lambda path, keys: summarize_torchsave(path),
        lambda path, progress: verify_torchsave(path),
        None,
        None,
    ),
    FULL: Format(
        FULL,
        "full safetensors",
        lambda path: is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists()),
        lambda path, keys: open_full_checkpoint(path),
        lambda path, keys: summarize_full(path),
        lambda path, progress: verify_full(path),
        None,
        to_full,
        Options(takes=("model", "max_shard_size", "cast_to", "with_optimizer")),
    ),
}
READ_LABELS = ", ".join(f.label for f in FORMATS.values())  # "fsdpkit, DCP, DeepSpeed, verl, full safetensors"
RESHARD_LABELS = ", ".join(f.label for f in FORMATS.values() if f.reshard is not None)
TARGETS = tuple(name for name, found in FORMATS.items() if found.write is not None)
CONVERT_HELP = f"Convert a checkpoint ({READ_LABELS}) --to {', '.join(TARGETS[:-1])} or {TARGETS[-1]}."


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of the checkpoint at `path`; a UsageError when it is none that fsdpkit reads
    (the format's reader then says what is wrong inside it)."""
    local_only(path, what="this reader")
    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    for found in sorted(FORMATS.values(), key=lambda f: f.name == SHARDED):
        if found.detect(path):
            return found
    raise UsageError(f"{path}: not a checkpoint fsdpkit reads ({READ_LABELS})")


def open_checkpoint(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> AnyCheckpoint:
    """The checkpoint at `path` in any format (`model_key`, `optimizer_key`: a DCP checkpoint's, as `Keys`)."""
    local_only(path, what="open_checkpoint")
    found = detect_format(path)
    opened = found.open(Path(path), Keys(model_key, optimizer_key))
    opened.format, opened.opened_from = found.name, str(path)
    return opened


def reshard_any(src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ReshardRequest) -> WriteReport:
    """`reshard`: the checkpoint at `src` laid out for `request.world_size` ranks, in its format."""
    local_only(src, dst, what="reshard")
    found = detect_format(src)
    if found.reshard is None:
        targets = [name for name in TARGETS if name != found.name]
        raise UsageError(
            f"{src}: a {found.label} checkpoint has no ranks to lay out: convert it --to {', '.join(targets[:-1])} or {targets[-1]}"
        )
    if request.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {request.world_size}")
    return WriteReport.of(found.reshard(Path(src), Path(dst), request))


def convert_any(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ConvertRequest, progress: Progress | None = None
) -> WriteReport:
    """`convert`: the checkpoint at `src`, opened as a tensor table, written by `request.to`'s
    writer (to its own format: `fsdpkit reshard`)."""
    local_only(src, dst, what="convert")
    source = detect_format(src)
    target = FORMATS.get(request.to)
    if target is None or target.write is None:
        raise UsageError(f"unknown --to {request.to!r}: use {', '.join(TARGETS[:-1])} or {TARGETS[-1]}")
    if target is source:
        others = [name for name in TARGETS if name != source.name]
        raise UsageError(
            f"a {source.name} checkpoint cannot be converted --to {target.name}: use --to {' or '.join(others)}; "
            "`fsdpkit reshard` lays it out for another world size"
        )
    check_options(source.name, source.reads, target.writes, request)
    with open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key) as opened:
        if not opened.model:
            hint = "; name them with --dcp-model-key" if "model_key" in source.reads.takes else ""
            raise DataCheckError(f"{src}: no model tensors found{hint}")
        facts = {"src": opened.path, "dst": str(dst), "from": source.name, **opened.facts}
        return WriteReport.of({**facts, **target.write(opened, Path(dst), request, progress)})
