"""`fsdpkit convert DIR OUT --to full|sharded|dcp|deepspeed`: per-rank `torch.save` state dicts of FSDP2 DTensors
or FSDP1 ShardedTensors (verl's checkpoint files) -> Hugging Face safetensors, an
fsdpkit checkpoint, DCP or DeepSpeed ZeRO, streamed through the byte engine."""

from __future__ import annotations

import os
from pathlib import Path

from ..dcp.export import DcpOutput, sources_to_dcp
from ..format.bytecopy import DEFAULT_CHUNK_SIZE
from ..format.export import HfExport
from ..format.names import split_optim_tensor_name
from ..torchsave.table import FORMAT, RankStateDicts, open_rank_state_dicts
from .convert import FullOutput, Progress, write_full
from .dcp_to_sharded import ShardedTarget, optimizer_steps, sources_to_sharded
from .to_deepspeed import RunShape, build_run, write_run


def torchsave_to_full(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    export: HfExport | None = None,
    with_optimizer: bool = False,
    options: FullOutput | None = None,
) -> dict:
    """The model files' tensors whole, under their state dict names, and with `with_optimizer`
    the optimizer state the optimizer files hold (`optim.<state>.<name>`, where they are read);
    the extra state (the LR scheduler's, the RNG states) is not written."""
    with open_rank_state_dicts(src) as checkpoint:
        optim = checkpoint.optimizer if with_optimizer else []
        report = write_full(checkpoint.model, optim, Path(dst), src=Path(src), export=export, aliases={}, options=options or FullOutput())
        ranks, skipped = checkpoint.world_size, checkpoint.other_files
    return {"src": str(src), "dst": str(dst), "from": FORMAT, "to": "full", "world_size": ranks, "not_read": skipped, **report}


def torchsave_to_dcp(src: str | os.PathLike[str], dst: str | os.PathLike[str], output: DcpOutput) -> dict:
    """FSDP2's `{"model", "optimizer"}` DCP layout chunked for `output.world_size` ranks: the
    model files' tensors, and where the optimizer files are read, Adam's state and its param
    group; the extra state (the LR scheduler's, the RNG states) is not written."""
    with open_rank_state_dicts(src) as checkpoint:
        sources = checkpoint.model + checkpoint.optimizer
        report = sources_to_dcp(sources, Path(src), Path(dst), aliases={}, groups=_groups(checkpoint), output=output)
        ranks, skipped = checkpoint.world_size, checkpoint.other_files
    return {**report, "from": FORMAT, "from_world_size": ranks, "not_read": skipped}


def torchsave_to_sharded(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: ShardedTarget) -> dict:
    """An fsdpkit sharded checkpoint of the weights and, where the optimizer files are read,
    Adam's state and its param group, laid out for `target.world_size` ranks by the model's
    placement (`fsdpkit train --resume` continues)."""
    with open_rank_state_dicts(src) as checkpoint:
        sources = checkpoint.model + checkpoint.optimizer
        report = sources_to_sharded(sources, Path(src), Path(dst), target, param_groups=_groups(checkpoint))
        ranks = checkpoint.world_size
    return {"src": str(src), "dst": str(dst), "from": FORMAT, "from_world_size": ranks, **report}


def torchsave_to_deepspeed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    stage: int,
    world_size: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    """A DeepSpeed ZeRO checkpoint of `stage` at `world_size` ranks (default: the files' ranks) of
    the weights, Adam's state and its param group, the step taken from Adam's."""
    with open_rank_state_dicts(src) as checkpoint:
        steps = optimizer_steps(checkpoint.optimizer, DEFAULT_CHUNK_SIZE)
        shape = RunShape(stage, world_size or checkpoint.world_size, steps)
        run = build_run({s.name: s for s in checkpoint.model + checkpoint.optimizer}, _groups(checkpoint), shape)
        return write_run(run, Path(src), Path(dst), source_kind=FORMAT, overwrite=overwrite, progress=progress)


def _groups(checkpoint: RankStateDicts) -> list[dict]:
    """The optimizer's param groups in fsdpkit's form: each group's settings over the parameters
    the optimizer files hold state of (verl's one group holds them all)."""
    params = list(dict.fromkeys(split[1] for s in checkpoint.optimizer if (split := split_optim_tensor_name(s.name))))
    return [{"settings": settings, "params": params} for settings in checkpoint.optim.param_groups] if params else []
