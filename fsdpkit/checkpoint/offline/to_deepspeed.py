"""`convert SRC OUT --to deepspeed --stage S [--world-size N]`: an fsdpkit sharded checkpoint
or a full safetensors directory with its optimizer file, as a DeepSpeed ZeRO checkpoint; and
`reshard DS OUT --world-size N`: a DeepSpeed checkpoint laid out for N ranks, same stage,
which DeepSpeed's plain `load_checkpoint` at N ranks resumes (no universal checkpoint).

A parameter is a model tensor with Adam moments (`optim.exp_avg.<name>`, `optim.exp_avg_sq.<name>`);
its group's step is `optim.step.<name>` of the group's first parameter. The groups and their
settings (lr, betas, eps, weight decay) are the ones the fsdpkit run recorded; a source without
them is one group with AdamW's defaults. Written under a temporary name, renamed when complete.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..deepspeed.table import open_deepspeed
from ..deepspeed.writer import MOMENTS, DsGroup, DsParam, DsRun, write_deepspeed
from ..format.bytecopy import ByteEngine, SourceTensor
from ..format.names import MANIFEST_NAME, optim_tensor_name
from ..format.reader import is_full_checkpoint, open_full, open_sharded
from ..format.storage import staged_output
from .convert import Progress, progress_callback

_STEP_FORMATS = {"F32": "<f", "F64": "<d", "I64": "<q", "I32": "<i"}


def _step(engine: ByteEngine, source: SourceTensor | None) -> float:
    if source is None:
        return 0.0
    fmt = _STEP_FORMATS.get(source.dtype)
    if fmt is None or source.nbytes != struct.calcsize(fmt):
        raise DataCheckError(f"{source.name}: a step of {source.dtype} {list(source.shape)}, expected one number")
    data = bytearray(source.nbytes)
    engine.read_into(source, ElementRange(0, 1), memoryview(data))
    return float(struct.unpack(fmt, data)[0])


def _groups(tensors: dict[str, SourceTensor], recorded: list[dict]) -> list[tuple[list[str], dict]]:
    """(parameter names, settings) of each group."""
    if recorded:
        return [(list(g.get("params", [])), dict(g.get("settings", {}))) for g in recorded]
    names = [n for n in tensors if optim_tensor_name(MOMENTS[0], n) in tensors]
    return [(names, {})]


def build_run(tensors: dict[str, SourceTensor], recorded: list[dict], *, stage: int, world_size: int, global_steps: int) -> DsRun:
    """The DeepSpeed run of a table of named tensors (model and `optim.<state>.<name>`)."""
    groups, engine = [], ByteEngine()
    try:
        for names, settings in _groups(tensors, recorded):
            params = []
            for name in names:
                if name not in tensors:
                    raise DataCheckError(f"the optimizer's group names parameter {name!r}, which the checkpoint does not hold")
                moments = {m: tensors[k] for m in MOMENTS if (k := optim_tensor_name(m, name)) in tensors}
                params.append(DsParam(name, tensors[name], moments))
            first = names[0] if names else ""
            groups.append(DsGroup(params, _step(engine, tensors.get(optim_tensor_name("step", first))), settings))
    finally:
        engine.close()
    if not any(g.params for g in groups):
        raise UsageError("the source holds no parameter with Adam state (optim.exp_avg.<name>): nothing to write for DeepSpeed")
    return DsRun(groups, stage, world_size, global_steps)


def to_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    stage: int,
    world_size: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    path = Path(src)
    if is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists()):
        full = open_full(path, with_optimizer=True)
        recorded: list[dict] = []
        tensors, kind, steps, saved_world = {t.name: t for t in full.tensors}, "safetensors-full", 0, 1
    else:
        sharded = open_sharded(path)
        state = sharded.manifest.training_state
        tensors = {t.name: t for t in sharded.sources()}
        recorded = (state.get("optimizer") or {}).get("groups") or []
        kind, steps, saved_world = "fsdpkit-checkpoint", int(state.get("step", 0) or 0), sharded.manifest.shard_factor
    run = build_run(tensors, recorded, stage=stage, world_size=world_size or saved_world, global_steps=steps)
    return write_run(run, path, Path(dst), source_kind=kind, overwrite=overwrite, progress=progress)


def write_run(run: DsRun, src: Path, dst: Path, *, source_kind: str, overwrite: bool, progress: Progress | None) -> dict:
    """`run` written as a DeepSpeed checkpoint at `dst` (staged, renamed when complete)."""
    total = sum(p.master.nbytes * 3 for g in run.groups for p in g.params)
    with staged_output(dst, src=src, overwrite=overwrite, needed_bytes=total + 4096 * (run.world_size + 4) * 4) as tmp:
        files = write_deepspeed(tmp, run, progress_callback(progress, total))
    return {
        "src": str(src),
        "dst": str(dst),
        "from": source_kind,
        "to": "deepspeed",
        "stage": run.stage,
        "world_size": run.world_size,
        "tag": run.tag,
        "files": files,
        "tensors": sum(len(g.params) for g in run.groups),  # parameters, each with its fp32 master and moments
        "bytes": total,
    }


def reshard_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    with open_deepspeed(src) as checkpoint:
        if checkpoint.precision != "F32" or checkpoint.frozen or checkpoint.buffers:
            kept = [*checkpoint.frozen, *checkpoint.buffers][:3]
            raise UsageError(
                f"{src}: fsdpkit writes DeepSpeed checkpoints of fp32 trainable parameters only; this one is {checkpoint.precision}"
                + (f" with frozen parameters or buffers ({', '.join(kept)}...)" if kept else "")
            )
        tensors = {t.name: t for t in checkpoint.sources}
        steps = checkpoint.global_steps or 0
        run = build_run(tensors, checkpoint.groups(), stage=checkpoint.stage, world_size=world_size, global_steps=steps)
        return write_run(run, Path(src), Path(dst), source_kind="deepspeed", overwrite=overwrite, progress=progress)
