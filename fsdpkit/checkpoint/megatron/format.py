"""Megatron-Core `torch_dist` and NeMo 2 checkpoints as a `Format` (core/protocol.py): detected,
opened as a tensor table under Megatron's own names (with a view under transformers' names for
`convert` and `diff`), inspected, verified and written (`to_megatron`); never resharded.
Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.files import source_path
from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from .files import FORMAT, is_megatron_checkpoint

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from .inspect import MegatronSummary


class MegatronFormat:
    name = FORMAT
    label = "Megatron"
    reads = Options()
    writes = Options(takes=("model",), why="--model hf:DIR names the transformers config of the model's shape")
    writable = True
    reshardable = False

    def detect(self, path: Path) -> bool:
        return is_megatron_checkpoint(source_path(path))

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        return open_megatron_checkpoint(path)

    def inspect(self, path: Path, keys: Keys) -> MegatronSummary:
        from .inspect import summarize_megatron

        return summarize_megatron(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .inspect import verify_megatron

        return verify_megatron(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        from .to_megatron import to_megatron  # the writer and DCP's: imported by --to megatron only

        return to_megatron(opened, dst, request, progress)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        raise UsageError(f"{src}: a {self.label} checkpoint has no ranks to lay out")


def open_megatron_checkpoint(path: Path) -> AnyCheckpoint:
    """Megatron's own names; `transformers_view(model)` gives the model under transformers' names,
    shaped by `model` (`hf:DIR`) where the checkpoint records no shape of its own."""
    from ..core.any_checkpoint import AnyCheckpoint, item_readers
    from ..core.export import ExportLayout, HfExport
    from .moments import hf_moments, moments_of, optimizer_facts
    from .shape import checked, shape_of_model
    from .table import open_megatron
    from .to_hf import hf_model

    checkpoint = open_megatron(path)
    where = str(checkpoint.files.root)
    try:
        moments = moments_of(checkpoint)
    except BaseException:
        checkpoint.close()
        raise

    def transformers_view(model: str | None) -> AnyCheckpoint:
        shape = checkpoint.shape if model is None else checked(shape_of_model(model).completed(checkpoint.shape), where)
        found = hf_model(checkpoint.model, shape, where)
        export = HfExport(found.config, ExportLayout(transposed=found.transposed))
        optimizer = hf_moments(moments.tensors, checkpoint.model, shape, where)
        view = AnyCheckpoint(
            where,
            {t.name: t for t in found.tensors},
            optimizer,
            export=export,
            facts=opened.facts,
            groups=moments.groups,
            step=moments.steps,
            step_once=True,
        )
        view.format, view.opened_from, view.opened_at = opened.format, opened.opened_from, opened.opened_at
        return view

    opened = AnyCheckpoint(
        where,
        dict(checkpoint.model),
        dict(moments.tensors),
        {key: t for key, t in checkpoint.stored.items() if key not in checkpoint.model},
        items=item_readers(checkpoint.common),
        groups=moments.groups,
        step=moments.steps,
        step_once=True,
        facts={"generation": checkpoint.generation, **optimizer_facts(moments)},
        transformers_view=transformers_view,
        _close=checkpoint.close,
    )
    return opened
