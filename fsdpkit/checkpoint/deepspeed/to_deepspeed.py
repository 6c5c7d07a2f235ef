"""`convert SRC OUT --to deepspeed --stage S [--world-size N]`: any checkpoint opened as a tensor
table with its Adam state, as a DeepSpeed ZeRO checkpoint; and `reshard DS OUT --world-size N`:
a DeepSpeed checkpoint laid out for N ranks, which DeepSpeed's plain `load_checkpoint` resumes.

A parameter is a model tensor with Adam moments (`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`);
its group's step is `optim.step.<name>` of the group's first parameter. A source without recorded
param groups is one group with AdamW's defaults.
"""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import DataCheckError, UsageError
from ..core.any_checkpoint import AnyCheckpoint, read_step
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.names import is_optimizer_tensor, optim_tensor_name
from ..core.report import WriteReport
from ..core.request import Progress, progress_callback
from ..core.staging import staged_output
from .table import DeepSpeedCheckpoint, open_deepspeed
from .writer import MOMENTS, DsGroup, DsParam, DsRun, write_deepspeed
from .writer_precision import Precision, saved_scale

if TYPE_CHECKING:
    from ..core.request import ConvertRequest


@dataclass(frozen=True)
class RunShape:
    """What a DeepSpeed run is laid out as, beyond its tensors."""

    stage: int
    world_size: int
    global_steps: int
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name kept
    buffers: tuple[str, ...] = ()
    global_samples: int = 0


def build_run(tensors: dict[str, SourceTensor], recorded: list[dict], shape: RunShape) -> DsRun:
    """The DeepSpeed run of a table of named tensors (model and `optim.<state>.<name>`): the
    groups' parameters with their Adam state; every other model tensor a buffer (when named
    so) or a frozen parameter."""
    adam = [n for n in tensors if optim_tensor_name(MOMENTS[0], n) in tensors]
    named = [(list(g.get("params", [])), dict(g.get("settings", {}))) for g in recorded] or [(adam, {})]
    groups = []
    with closing(ByteEngine()) as engine:
        for names, settings in named:
            params = []
            for name in names:
                if name not in tensors:
                    raise DataCheckError(f"the optimizer's group names parameter {name!r}, which the checkpoint does not hold")
                moments = {m: tensors[k] for m in MOMENTS if (k := optim_tensor_name(m, name)) in tensors}
                params.append(DsParam(name, tensors[name], moments))
            step = tensors.get(optim_tensor_name("step", names[0] if names else ""))
            groups.append(DsGroup(params, read_step(engine, step) if step is not None else 0.0, settings))
    if not any(g.params for g in groups):
        raise UsageError("the source holds no parameter with Adam state (optim.exp_avg.<name>): nothing to write for DeepSpeed")
    trained = {p.name for g in groups for p in g.params}
    others = [t for name, t in tensors.items() if name not in trained and not is_optimizer_tensor(name) and name not in shape.aliases]
    return DsRun(
        groups,
        shape.stage,
        shape.world_size,
        shape.global_steps,
        frozen=tuple(t for t in others if t.name not in shape.buffers),
        buffers=tuple(t for t in others if t.name in shape.buffers),
        aliases={a: k for a, k in shape.aliases.items() if k in tensors},
        global_samples=shape.global_samples,
    )


def to_deepspeed(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
    """`--to deepspeed`: a DeepSpeed ZeRO checkpoint of `--stage` at `--world-size` ranks
    (default: the source's) of the parameters with Adam state, their groups and step."""
    assert request.stage is not None  # the writer needs it
    tensors = {t.name: t for t in opened.stored()}
    run = build_run(tensors, opened.groups, RunShape(request.stage, request.world_size or opened.world_size, opened.step, opened.aliases))
    return write_run(run, Path(opened.opened_from), dst, overwrite=request.overwrite, progress=progress)


def write_run(run: DsRun, src: Path, dst: Path, *, overwrite: bool, progress: Progress | None) -> WriteReport:
    """`run` written as a DeepSpeed checkpoint at `dst` (staged, renamed when complete)."""
    total = sum(p.master.nbytes * 3 for g in run.groups for p in g.params)
    with staged_output(dst, src=src, overwrite=overwrite, needed_bytes=total + 4096 * (run.world_size + 4) * 4) as tmp:
        files = write_deepspeed(tmp, run, progress_callback(progress, total))
    details = {"to": "deepspeed", "stage": run.stage, "world_size": run.world_size, "tag": run.tag}
    parameters = sum(len(g.params) for g in run.groups)  # each with its fp32 master and moments
    return WriteReport(str(src), str(dst), files, parameters, total, [], details)


def reshard_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> WriteReport:
    with open_deepspeed(src) as checkpoint:
        return write_run(resharded_run(checkpoint, world_size), Path(src), Path(dst), overwrite=overwrite, progress=progress)


def resharded_run(checkpoint: DeepSpeedCheckpoint, world_size: int) -> DsRun:
    """The run of `checkpoint` laid out for `world_size` ranks, its precision and loss scale kept."""
    tensors = {t.name: t for t in checkpoint.sources}
    samples = checkpoint.items.get("global_samples")
    shape = RunShape(
        checkpoint.stage,
        world_size,
        checkpoint.global_steps or 0,
        checkpoint.aliases,
        checkpoint.buffers,
        samples if type(samples) is int else 0,
    )
    run = build_run(tensors, checkpoint.groups(), shape)
    return replace(run, precision=Precision(checkpoint.precision), loss_scale=saved_scale(checkpoint.loss_scaler))
