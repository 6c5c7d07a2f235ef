"""`fsdpkit inspect` and `fsdpkit verify` of a DeepSpeed ZeRO checkpoint: a `DeepSpeedSummary`
and a `VerifyReport` (no torch, no deepspeed)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

from ...errors import DataCheckError
from ..core.files import source_path
from ..core.report import VerifyReport
from ..core.summary import FileEntry, ModelCounts, OptimizerStates, Summary, TensorEntry, largest, tensor_entry
from ..torchfile.savefile import verify_saved_files
from ..torchfile.unpickler import count_items
from .table import FORMAT, DeepSpeedCheckpoint, open_deepspeed


@dataclass(frozen=True)
class DeepSpeedModel(ModelCounts):
    trainable: int  # held by the optimizer as fp32 masters
    frozen: list[str]
    buffers: list[str]
    tied: dict[str, str]


@dataclass(frozen=True)
class DeepSpeedSummary(Summary):
    model: DeepSpeedModel
    optimizer: OptimizerStates
    tag: str
    stage: int
    precision: str
    world_size: int
    ds_version: str
    global_steps: int | None
    tensors: list[TensorEntry]
    items: dict[str, int]  # the non-tensor items, counted by top-level key


def summarize_deepspeed(path: str | os.PathLike[str]) -> DeepSpeedSummary:
    with open_deepspeed(path) as checkpoint:
        model = [tensor_entry(s) for s in checkpoint.model]
        optim = checkpoint.optimizer
        return DeepSpeedSummary(
            path=str(checkpoint.directory),
            format=FORMAT,
            model=DeepSpeedModel(
                len(model),
                sum(s.numel for s in checkpoint.model),
                sum(t.bytes for t in model),
                len(model) - len(checkpoint.frozen) - len(checkpoint.buffers),
                list(checkpoint.frozen),
                list(checkpoint.buffers),
                checkpoint.aliases,
            ),
            optimizer=OptimizerStates(
                len(optim), sum(s.nbytes for s in optim), sorted(Counter(s.name.split(".")[1] for s in optim)), checkpoint.param_groups
            ),
            dtypes=dict(Counter(s.dtype for s in checkpoint.sources)),
            largest=largest(model),
            files=[FileEntry(rf.path.name, rf.size) for rf in checkpoint.opened],
            tag=checkpoint.files.tag,
            stage=checkpoint.stage,
            precision=checkpoint.precision,
            world_size=checkpoint.world_size,
            ds_version=checkpoint.ds_version,
            global_steps=checkpoint.global_steps,
            tensors=model + [tensor_entry(s) for s in optim],
            items={k: count_items(v) for k, v in {**checkpoint.items, "optimizer.param_groups": checkpoint.param_groups}.items()},
        )


def verify_deepspeed(path: str | os.PathLike[str]) -> VerifyReport:
    report = VerifyReport(str(path), FORMAT)
    try:
        checkpoint = open_deepspeed(source_path(path))
    except DataCheckError as error:
        return report.failed(str(error))
    with checkpoint:
        return verify_opened(checkpoint, report)


def verify_opened(checkpoint: DeepSpeedCheckpoint, report: VerifyReport, crcs: list[tuple[int, list[str]]] | None = None) -> VerifyReport:
    """Every check of an opened DeepSpeed checkpoint into `report` (`crcs`: its files' storages
    already checked, by the ranks of a spread verify)."""
    verify_saved_files(report, checkpoint.directory, checkpoint.sources, checkpoint.opened, crcs)
    report.checked = [
        f"{len(checkpoint.opened)} rank files present ({checkpoint.world_size} ranks), each a readable zip",
        *report.checked,
        "every parameter and optimizer state covered exactly once by the partitions",
    ]
    return report
