"""Every checkpoint format fsdpkit reads, by its one name (the one `convert --to`, the `--json`
reports and `open_checkpoint(...).format` use): FORMATS, one `Format` (core/protocol.py) per
format, each implemented in its own package. `detect_format` is the only place that tells a
format; `convert` is `FORMATS[to].write(open(src))`, and `inspect`, `verify` and `reshard` go
through the format too. Adding a format is its package and one entry here.
Reading the table imports no torch (the offline side of every format is pure Python), nor any
format's reader: detecting a format imports what its `detect` needs, opening one its package.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import DataCheckError, UsageError
from ..core.files import source_path
from ..core.request import ConvertRequest, Keys, Progress, ReshardRequest, check_options
from ..dcp.format import DcpFormat
from ..deepspeed.format import DeepSpeedFormat
from ..format.format import ShardedFormat
from ..format.full_format import FullFormat
from ..megatron.format import MegatronFormat
from ..storage.lease import WRITING_MARKER
from ..storage.location import is_url
from ..torchsave.format import TorchSaveFormat
from .locations import local_only, source_at

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.protocol import Format
    from ..core.report import WriteReport

# In the order messages list them and `detect_format` tries them. A Megatron torch_dist directory
# is a DCP directory too: Megatron comes before DCP. A DeepSpeed save directory has a `latest` as
# fsdpkit's run directory does: `detect_format` tries fsdpkit's own format last.
FORMATS: dict[str, Format] = {
    f.name: f for f in (ShardedFormat(), MegatronFormat(), DcpFormat(), DeepSpeedFormat(), TorchSaveFormat(), FullFormat())
}
SHARDED, MEGATRON, DCP, DEEPSPEED, TORCH_SAVE, FULL = (
    ShardedFormat.name,
    MegatronFormat.name,
    DcpFormat.name,
    DeepSpeedFormat.name,
    TorchSaveFormat.name,
    FullFormat.name,
)
READ_LABELS = ", ".join(f.label for f in FORMATS.values())  # "fsdpkit, Megatron, DCP, DeepSpeed, verl, full safetensors"
RESHARD_LABELS = ", ".join(f.label for f in FORMATS.values() if f.reshardable)
TARGETS = tuple(name for name, found in FORMATS.items() if found.writable)
CONVERT_HELP = f"Convert a checkpoint ({READ_LABELS}) --to {', '.join(TARGETS[:-1])} or {TARGETS[-1]}."


def detect_format(path: str | os.PathLike[str]) -> Format:
    """The format of the checkpoint at `path`; a UsageError when it is none that fsdpkit reads
    (the format's reader then says what is wrong inside it)."""
    local_only(path, what="this reader")
    path = source_path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    for found in [*(f for f in FORMATS.values() if f.name != SHARDED), FORMATS[SHARDED]]:
        if found.detect(path):
            return found
    if (path / WRITING_MARKER).exists():
        unfinished = f"{WRITING_MARKER} says an fsdpkit write is under way here, or was cut short (no commit object)"
        raise UsageError(f"{path}: no checkpoint yet: {unfinished}")
    raise UsageError(f"{path}: not a checkpoint fsdpkit reads ({READ_LABELS})")


def open_checkpoint(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> AnyCheckpoint:
    """The checkpoint at `path` in any format (`model_key`, `optimizer_key`: a DCP checkpoint's, as `Keys`)."""
    source = source_at(path) if is_url(path) else source_path(path)
    found = detect_format(source)
    opened = found.open(source, Keys(model_key, optimizer_key))
    opened.format, opened.opened_from, opened.opened_at = found.name, str(path), source
    return opened


def reshard_any(src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ReshardRequest) -> WriteReport:
    """`reshard`: the checkpoint at `src` laid out for `request.world_size` ranks, in its format."""
    local_only(src, dst, what="reshard")
    found = detect_format(src)
    if not found.reshardable:
        with found.open(source_path(src), Keys(None, None)):  # a corrupt one is called that first (DataCheckError)
            pass
        targets = [name for name in TARGETS if name != found.name]
        raise UsageError(
            f"{src}: a {found.label} checkpoint has no ranks to lay out: convert it --to {', '.join(targets[:-1])} or {targets[-1]}"
        )
    return found.reshard(source_path(src), Path(dst), request)


def convert_target(source: Format, request: ConvertRequest) -> Format:
    """The format `request` converts a `source` checkpoint to; a UsageError for one it cannot, or
    for an option that does not apply."""
    target = FORMATS.get(request.to)
    if target is None or not target.writable:
        raise UsageError(f"unknown --to {request.to!r}: use {', '.join(TARGETS[:-1])} or {TARGETS[-1]}")
    if target is source:
        others = [name for name in TARGETS if name != source.name]
        raise UsageError(
            f"a {source.name} checkpoint cannot be converted --to {target.name}: use --to {' or '.join(others)}; "
            "`fsdpkit reshard` lays it out for another world size"
        )
    check_options(source.name, source.reads, target.writes, request)
    return target


def convert_any(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ConvertRequest, progress: Progress | None = None
) -> WriteReport:
    """`convert`: the checkpoint at `src`, opened as a tensor table, written by `request.to`'s
    writer (to its own format: `fsdpkit reshard`)."""
    local_only(src, dst, what="convert")
    source = detect_format(src)
    target = convert_target(source, request)
    with open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key) as opened:
        if not opened.model:
            hint = "; name them with --dcp-model-key" if "model_key" in source.reads.takes else ""
            raise DataCheckError(f"{src}: no model tensors found{hint}")
        written = target.write(opened, Path(dst), request, progress)
        return replace(written, details={"from": source.name, **opened.facts, **written.details})
