"""fsdpkit's sharded output. `convert SRC OUT --to sharded --world-size N [--model M]`: any
checkpoint opened as a tensor table -> an fsdpkit sharded checkpoint with its optimizer state,
which `fsdpkit train --resume OUT` continues at any N. Laid out by `--model`'s flat-parameter
placement, or an even split per tensor; a full export's layout is undone unless the placement
names the tensors as they are. `reshard OUT2 --world-size N`: an fsdpkit checkpoint laid out for
N ranks with the same placement, its training state carried over.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..core.any_checkpoint import AnyCheckpoint
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.export import EXPORT_STATE_KEY
from ..core.model_description import ModelDescription
from ..core.names import SCRATCH_NAME, optim_tensor_name, output_dtype, split_optim_tensor_name
from ..core.report import WriteReport
from ..core.request import ConvertRequest, Progress, ReshardRequest, progress_callback
from ..core.staging import staged_output
from .manifest import Manifest, resharded_training_state
from .placement import Placement, TensorSpec
from .reader import open_sharded
from .to_full import as_transformers, restore_layout
from .writer import write_sharded

STEP_SCRATCH_NAME = ".fsdpkit-step.scratch"  # the one step value of a source that records it once


def _canonical(sources: list[SourceTensor], aliases: dict[str, str]) -> list[SourceTensor]:
    """Drop the alias names of tied weights (model and optimizer state) whose canonical name is there;
    a tensor kept only under an alias is renamed to the canonical name."""
    names = {s.name for s in sources}
    kept = []
    for source in sources:
        optim = split_optim_tensor_name(source.name)
        param = optim[1] if optim else source.name
        if param in aliases:
            canonical = f"optim.{optim[0]}.{aliases[param]}" if optim else aliases[param]
            if canonical in names:
                continue
            source = SourceTensor(canonical, source.shape, source.dtype, tuple(source.pieces_in(ElementRange(0, source.numel))))
        kept.append(source)
    return kept


def step_sources(sources: list[SourceTensor], step: int, scratch: Path) -> list[SourceTensor]:
    """Adam's step as a tensor for each parameter with moments, for a source that records it
    once: the one float32 value written to `scratch` (removed once the rank files are written)."""
    params = [split[1] for s in sources if (split := split_optim_tensor_name(s.name)) and split[0] == "exp_avg"]
    if not params:
        return []
    scratch.write_bytes(struct.pack("<f", float(step)))
    piece = SourcePiece(ElementRange(0, 1), scratch, 0, 4, None, "step")
    return [
        SourceTensor(optim_tensor_name("step", param), (), "F32", (piece._replace(key=optim_tensor_name("step", param)),))
        for param in params
    ]


def with_steps(opened: AnyCheckpoint, sources: list[SourceTensor], request: ConvertRequest, scratch: Path | None) -> list[SourceTensor]:
    """`sources` with a step per parameter where the source records it once (Megatron), written
    beside `scratch`; a spread conversion (no scratch) refuses --with-optimizer and leaves the
    moments out otherwise."""
    if not opened.step_once or not any(split_optim_tensor_name(s.name) for s in sources):
        return sources
    if scratch is not None:
        return sources + step_sources(sources, opened.step, scratch.with_name(STEP_SCRATCH_NAME))
    if request.with_optimizer:
        raise UsageError(
            f"{opened.opened_from}: --with-optimizer: a {opened.format} checkpoint records Adam's step once, which a spread"
            " conversion does not write per parameter: convert in one process"
        )
    return [s for s in sources if not split_optim_tensor_name(s.name)]


def check_placement_matches(placement: Placement, sources: list[SourceTensor], *, where: Path, source: str) -> None:
    shapes, expected = {s.name: s.shape for s in sources}, placement.param_shapes()
    missing = [name for name in expected if name not in shapes]
    wrong = [f"{name} {list(shapes[name])} (model: {list(shape)})" for name, shape in expected.items() if shapes.get(name, shape) != shape]
    if missing or wrong:
        detail = f"missing {missing[:3]}" if missing else f"different shapes {wrong[:3]}"
        raise DataCheckError(f"{where}: does not match {source}: {detail}")


@dataclass(frozen=True)
class ShardedOutput:
    """What `--to sharded` writes: the tensors it copies (in fsdpkit's names and orientation), the
    manifest of the rank files, and what the report says of them."""

    sources: list[SourceTensor]
    manifest: Manifest
    details: dict


def sharded_source(opened: AnyCheckpoint, request: ConvertRequest) -> AnyCheckpoint:
    """The checkpoint `--to sharded` copies: a Megatron one's model under transformers' names."""
    if opened.transformers_view is not None:  # Megatron: the model as transformers names it, as an hf: model's are
        return as_transformers(opened, request, None)
    return opened


def restores_layout(opened: AnyCheckpoint, description: ModelDescription | None) -> bool:
    """Whether `sharded_output` transposes a full export's weights back into its scratch file."""
    if opened.export_layout is None:
        return False
    if description is None:
        return True
    names = {s.name for s in opened.stored()}
    return not all(n in names for n in Placement.flat(description.units).param_shapes())


def sharded_output(
    opened: AnyCheckpoint, request: ConvertRequest, description: ModelDescription | None, scratch: Path | None
) -> ShardedOutput:
    """The output of `--to sharded` from `opened` (`sharded_source`'s) laid out by `--model`'s
    `description`, a full export's transposed weights transposed back into `scratch` when `restores_layout`."""
    assert request.world_size is not None  # the writer needs it
    placement = Placement.flat(description.units) if description is not None else Placement.even()
    src = Path(opened.opened_from)
    if request.with_optimizer and not opened.optimizer:
        raise DataCheckError(f"{src}: --with-optimizer given but the checkpoint has no optimizer state")
    sources, stored = opened.stored(), opened.aliases
    if restores_layout(opened, description):
        assert opened.export_layout is not None and scratch is not None
        sources, stored = restore_layout(sources, opened.aliases, opened.export_layout, src, scratch, chunk_size=request.chunk_size)
    aliases = {**(description.aliases if description else {}), **stored}
    sources = with_steps(opened, _canonical(sources, aliases), request, scratch)
    kept = {s.name for s in sources}
    if description is not None:
        model = [s for s in sources if not split_optim_tensor_name(s.name)]
        check_placement_matches(placement, model, where=src, source=f"model {request.model!r}")
    groups = [{**g, "params": list(dict.fromkeys(aliases.get(n, n) for n in g.get("params", [])))} for g in opened.groups]
    state: dict = {"step": opened.step, "optimizer_steps": opened.step, "optimizer": {"stateless": [], "groups": groups}}
    export = description.export if description is not None and description.export is not None else opened.export
    if export is not None:
        state[EXPORT_STATE_KEY] = export.to_json()
    tensors = tuple(TensorSpec(s.name, output_dtype(s.dtype, request.cast_to), tuple(s.shape)) for s in sources)
    tied = {a: t for a, t in aliases.items() if t in kept and a not in kept}
    manifest = Manifest(request.world_size, "full", placement, tensors, tied, state)
    details = {
        "to": "sharded",
        "world_size": request.world_size,
        "placement": placement.kind,
        "step": opened.step,
        "optimizer_tensors": len([s for s in sources if split_optim_tensor_name(s.name)]),
        "dtype": request.cast_to,
        "param_groups": len(groups),
    }
    return ShardedOutput(sources, manifest, details)


def to_sharded(opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
    from ..core.model_description import describe

    assert request.world_size is not None  # the writer needs it
    opened = sharded_source(opened, request)
    world_size = request.world_size
    description = describe(request.model) if request.model is not None else None
    src = Path(opened.opened_from)
    sources = opened.stored()
    needed = 2 * sum(s.numel * dtype_info(output_dtype(s.dtype, request.cast_to)).itemsize for s in sources) + world_size * 65536
    needed_for = f" for {world_size} rank files (--world-size {world_size})"
    with staged_output(dst, src=src, overwrite=request.overwrite, needed_bytes=needed, needed_for=needed_for) as tmp:
        output = sharded_output(opened, request, description, tmp / SCRATCH_NAME)
        manifest = output.manifest
        written = write_sharded(
            tmp,
            sources=output.sources,
            placement=manifest.placement,
            world_size=world_size,
            strategy=manifest.strategy,
            training_state=manifest.training_state,
            aliases=manifest.aliases,
            cast_to=request.cast_to,
            chunk_size=request.chunk_size,
            progress=progress_callback(progress, sum(s.nbytes for s in output.sources)),
        )
        (tmp / SCRATCH_NAME).unlink(missing_ok=True)
        (tmp / STEP_SCRATCH_NAME).unlink(missing_ok=True)
    return WriteReport(opened.path, str(dst), written.files, len(written.manifest.tensors), written.bytes, [], output.details)


def reshard_sharded(src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
    """The checkpoint at `src` (a run or step directory) laid out for `request.world_size` ranks at
    `dst`; per-rank training state that cannot follow is dropped with a warning (`request.warn`)."""
    world_size = request.world_size
    checkpoint = open_sharded(src)
    old = checkpoint.manifest
    state, warnings = resharded_training_state(old.training_state, old_world_size=old.shard_factor, new_world_size=world_size)
    for line in warnings:
        if request.warn is not None:
            request.warn(line)
    sources = checkpoint.sources()
    total = sum(s.nbytes for s in sources)
    needed_for = f" for {world_size} rank files (--world-size {world_size})"
    with staged_output(dst, src=src, overwrite=request.overwrite, needed_bytes=total + world_size * 65536, needed_for=needed_for) as tmp:
        written = write_sharded(
            tmp,
            sources=sources,
            placement=old.placement,
            world_size=world_size,
            strategy=old.strategy,
            training_state=state,
            aliases=old.aliases,
            cast_to=None,
            chunk_size=request.chunk_size,
            progress=progress_callback(request.progress, total),
        )
    details = {"from_world_size": old.shard_factor, "world_size": world_size, "placement": old.placement.kind}
    return WriteReport(str(checkpoint.step_dir), str(dst), written.files, len(written.manifest.tensors), written.bytes, warnings, details)
