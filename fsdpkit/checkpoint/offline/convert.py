"""`convert` and `reshard` of any format: the source's format told (formats.py), the request
checked against it and the target, then the target format's `write` (or the source format's own
`reshard`) does the work and returns its `WriteReport`."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ..core.report import WriteReport
from ..core.request import ConvertRequest, Progress, ReshardRequest, check_options
from .formats import FORMATS, TARGETS, detect_format, open_checkpoint


def reshard_any(src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ReshardRequest) -> WriteReport:
    """`reshard`: the checkpoint at `src` laid out for `request.world_size` ranks, in its format."""
    found = detect_format(src)
    if not found.reshardable:
        targets = [name for name in TARGETS if name != found.name]
        raise UsageError(
            f"{src}: a {found.label} checkpoint has no ranks to lay out: convert it --to {', '.join(targets[:-1])} or {targets[-1]}"
        )
    return found.reshard(Path(src), Path(dst), request)


def convert_any(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], request: ConvertRequest, progress: Progress | None = None
) -> WriteReport:
    """`convert`: the checkpoint at `src`, opened as a tensor table, written by `request.to`'s
    writer (to its own format: `fsdpkit reshard`)."""
    source = detect_format(src)
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
    with open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key) as opened:
        if not opened.model:
            hint = "; name them with --dcp-model-key" if "model_key" in source.reads.takes else ""
            raise DataCheckError(f"{src}: no model tensors found{hint}")
        written = target.write(opened, Path(dst), request, progress)
        return replace(written, details={"from": source.name, **opened.facts, **written.details})
