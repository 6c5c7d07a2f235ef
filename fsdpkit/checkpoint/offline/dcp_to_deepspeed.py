"""`convert DCP OUT --to deepspeed --stage S --world-size N`: a DCP checkpoint (FSDP2,
torchtitan) with AdamW state as a DeepSpeed ZeRO checkpoint: the model and optimizer keys
found as for `--to sharded`, the param groups and Adam's step carried."""

from __future__ import annotations

import os
from pathlib import Path

from ..dcp.layout import model_and_optimizer
from ..dcp.table import open_dcp
from ..format.bytecopy import DEFAULT_CHUNK_SIZE
from .convert import Progress
from .dcp_to_sharded import dcp_param_groups, optimizer_steps
from .to_deepspeed import RunShape, build_run, write_run


def dcp_to_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    stage: int,
    world_size: int,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    with open_dcp(src) as checkpoint:
        layout, model, optim = model_and_optimizer(checkpoint, model_key=model_key, optimizer_key=optimizer_key)
        groups = dcp_param_groups(checkpoint, layout.optimizer_key, {}) if layout.optimizer else []
        steps = optimizer_steps(optim, DEFAULT_CHUNK_SIZE)
        run = build_run({s.name: s for s in model + optim}, groups, RunShape(stage, world_size, steps))
        return write_run(run, Path(src), Path(dst), source_kind="dcp", overwrite=overwrite, progress=progress)
