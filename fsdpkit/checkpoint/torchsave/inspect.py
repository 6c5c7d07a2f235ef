"""`fsdpkit inspect` and `fsdpkit verify` of per-rank `torch.save` state dicts: a `TorchSaveSummary` and a `VerifyReport`."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ...errors import DataCheckError
from ..core.files import source_path
from ..core.report import VerifyReport
from ..core.summary import FileEntry, ModelCounts, OptimizerStates, Summary, TensorEntry, largest, tensor_entry
from ..torchfile.savefile import verify_saved_files
from ..torchfile.unpickler import count_items
from .table import FORMAT, RankStateDicts, open_rank_state_dicts


@dataclass(frozen=True)
class TorchSaveOptimizer(OptimizerStates):
    not_read: str  # why the optimizer files were not read ("": they were)


@dataclass(frozen=True)
class TorchSaveSummary(Summary):
    optimizer: TorchSaveOptimizer
    world_size: int
    sharding: str
    tensors: list[TensorEntry]
    items: dict[str, int]  # rank 0's extra state, counted by top-level key
    extra_state: dict[str, Any]
    not_read: list[str]  # files of the directory not read


def summarize_torchsave(path: str | os.PathLike[str]) -> TorchSaveSummary:
    with open_rank_state_dicts(path) as checkpoint:
        model = [tensor_entry(s) for s in checkpoint.model]
        optim = checkpoint.optim
        states = sorted(Counter(s.name.split(".")[1] for s in optim.tensors))
        optim_bytes = sum(s.nbytes for s in optim.tensors)
        return TorchSaveSummary(
            path=str(checkpoint.directory),
            format=FORMAT,
            model=ModelCounts(len(model), sum(s.numel for s in checkpoint.model), sum(t.bytes for t in model)),
            optimizer=TorchSaveOptimizer(len(optim.tensors), optim_bytes, states, optim.param_groups, optim.not_read),
            dtypes=dict(Counter(s.dtype for s in checkpoint.model + optim.tensors)),
            largest=largest(model),
            files=[FileEntry(rf.path.name, rf.size) for rf in checkpoint.opened],
            world_size=checkpoint.world_size,
            sharding=checkpoint.sharding,
            tensors=model + [tensor_entry(s) for s in optim.tensors],
            items={key: count_items(value) for key, value in checkpoint.extra_state.items()},
            extra_state=checkpoint.extra_state,
            not_read=checkpoint.other_files,
        )


def verify_torchsave(path: str | os.PathLike[str]) -> VerifyReport:
    report = VerifyReport(str(path), FORMAT)
    try:
        checkpoint = open_rank_state_dicts(source_path(path))
    except DataCheckError as error:
        return report.failed(str(error))
    with checkpoint:
        return verify_opened(checkpoint, report)


def verify_opened(checkpoint: RankStateDicts, report: VerifyReport, crcs: list[tuple[int, list[str]]] | None = None) -> VerifyReport:
    """Every check of opened per-rank state dicts into `report` (`crcs`: their files' storages
    already checked, by the ranks of a spread verify)."""
    verify_saved_files(report, checkpoint.directory, checkpoint.model + checkpoint.optim.tensors, checkpoint.opened, crcs)
    files = (
        f"{len(checkpoint.opened)} files present ({checkpoint.world_size} ranks' model files"
        + (", optimizer files" if checkpoint.optim.tensors else "")
        + (", extra state files" if checkpoint.extra_state else "")
        + "), each a readable zip"
    )
    report.checked = [
        files,
        *report.checked,
        "every tensor covered exactly once by the ranks' parts",
        f"not read: {', '.join(checkpoint.other_files) or 'nothing'}"
        + (f" (optimizer files: {checkpoint.optim.not_read})" if checkpoint.optim.not_read else ""),
    ]
    return report
