"""`fsdpkit convert DCP OUT --to sharded --world-size N --model ...`: a DCP checkpoint (FSDP2,
torchtitan) -> an fsdpkit sharded checkpoint with its optimizer state, so `fsdpkit train
--resume OUT` continues the run at any N (no torch).

The model tensors and the optimizer state (`optim.<state>.<fqn>`) are laid out by the model's
flat-parameter placement and written by the fsdpkit writer, chunk by chunk. Tied weights:
FSDP2's state dict holds every name; fsdpkit stores the canonical one and records the alias.
The training state takes the step from Adam's `step` (the optimizer steps taken) and the
model's export recipe, and the optimizer's param groups (`param_groups`: plain values read
with an unpickler that refuses every global), so a later `--to dcp` writes them back.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ...errors import UsageError
from ...flat_layout import ElementRange
from ..dcp.layout import model_and_optimizer
from ..dcp.param_groups import read_param_groups
from ..dcp.table import DcpCheckpoint, open_dcp
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..format.export import EXPORT_STATE_KEY, HfExport
from ..format.names import split_optim_tensor_name
from ..format.placement import Placement
from ..format.storage import staged_output
from ..format.writer import write_sharded
from .convert import Progress, check_placement_matches, progress_callback


def _canonical(sources: list[SourceTensor], aliases: dict[str, str]) -> list[SourceTensor]:
    """Drop the alias names of tied weights (model and optimizer state) whose canonical name is there;
    an optimizer state kept only under an alias is renamed to the canonical name."""
    names = {s.name for s in sources}
    kept = []
    for source in sources:
        optim = split_optim_tensor_name(source.name)
        param = optim[1] if optim else source.name
        if param in aliases:
            canonical = f"optim.{optim[0]}.{aliases[param]}" if optim else aliases[param]
            if canonical in names:
                continue
            source = _renamed(source, canonical)
        kept.append(source)
    return kept


def _renamed(source: SourceTensor, name: str) -> SourceTensor:
    return SourceTensor(name, source.shape, source.dtype, tuple(source.pieces_in(ElementRange(0, source.numel))))


def dcp_param_groups(checkpoint: DcpCheckpoint, optimizer_key: str | None, aliases: dict[str, str]) -> list[dict]:
    """The checkpoint's param groups, the tied aliases among their fqns named canonically."""
    groups = read_param_groups(list(checkpoint.metadata.bytes_items), checkpoint.read_bytes_item, optimizer_key=optimizer_key or "")
    for group in groups:
        group["params"] = list(dict.fromkeys(aliases.get(name, name) for name in group["params"]))
    return groups


def optimizer_steps(sources: list[SourceTensor], chunk_size: int) -> int:
    """Adam's step (F32 scalar, the same for every parameter): the optimizer steps taken."""
    steps = [s for s in sources if (split := split_optim_tensor_name(s.name)) and split[0] == "step" and s.numel == 1 and s.dtype == "F32"]
    if not steps:
        return 0
    copier = ByteEngine(chunk_size=chunk_size)
    out = bytearray(4)
    try:
        copier.read_into(steps[0], ElementRange(0, 1), memoryview(out))
    finally:
        copier.close()
    return int(struct.unpack("<f", out)[0])


@dataclass(frozen=True)
class ShardedTarget:
    """The fsdpkit checkpoint a foreign checkpoint is converted into."""

    world_size: int
    placement: Placement
    placement_source: str
    aliases: dict[str, str]
    export: HfExport | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    overwrite: bool = False
    progress: Progress | None = None


def sources_to_sharded(
    sources: list[SourceTensor], src: Path, dst: Path, target: ShardedTarget, *, param_groups: list[dict] | None = None
) -> dict:
    """Model and optimizer sources (fsdpkit's names) -> an fsdpkit sharded checkpoint at `dst`,
    laid out by the model's placement; the step from Adam's `step`; the optimizer's param groups
    (lr, betas, ...) as the source recorded them."""
    if target.world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {target.world_size}")
    sources = _canonical(sources, target.aliases)
    check_placement_matches(
        target.placement, [s for s in sources if not split_optim_tensor_name(s.name)], where=src, source=target.placement_source
    )
    step = optimizer_steps(sources, target.chunk_size)
    groups = param_groups or []
    state: dict = {"step": step, "optimizer_steps": step, "optimizer": {"stateless": [], "groups": groups}}
    if target.export is not None:
        state[EXPORT_STATE_KEY] = target.export.to_json()
    total = sum(s.nbytes for s in sources)
    with staged_output(dst, src=src, overwrite=target.overwrite, needed_bytes=total + target.world_size * 65536) as tmp:
        written = write_sharded(
            tmp,
            sources=sources,
            placement=target.placement,
            world_size=target.world_size,
            strategy="full",
            training_state=state,
            aliases={a: t for a, t in target.aliases.items() if t in {s.name for s in sources}},
            cast_to=None,
            chunk_size=target.chunk_size,
            progress=progress_callback(target.progress, total),
        )
    optimizer_tensors = len([s for s in sources if split_optim_tensor_name(s.name)])
    return {
        "to": "sharded",
        "world_size": target.world_size,
        "placement": target.placement.kind,
        "step": step,
        "optimizer_tensors": optimizer_tensors,
        "files": written.files,
        "tensors": len(written.manifest.tensors),
        "bytes": written.bytes,
        "param_groups": len(groups),
    }


def dcp_to_sharded(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    world_size: int,
    placement: Placement,
    placement_source: str,
    aliases: dict[str, str],
    export: HfExport | None = None,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> dict:
    if world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    with open_dcp(src) as checkpoint:
        layout, model, optim = model_and_optimizer(checkpoint, model_key=model_key, optimizer_key=optimizer_key)
        groups = dcp_param_groups(checkpoint, layout.optimizer_key, aliases) if layout.optimizer else []
        target = ShardedTarget(world_size, placement, placement_source, aliases, export, chunk_size, overwrite, progress)
        report = sources_to_sharded(model + optim, Path(src), Path(dst), target, param_groups=groups)
    return {
        "src": str(src),
        "dst": str(dst),
        "from": "dcp",
        **report,
    }
