"""`fsdpkit inspect` and `fsdpkit verify` of a DeepSpeed ZeRO checkpoint, as JSON-able dicts
(no torch, no deepspeed).

inspect: stage, precision, ranks, ds_version, global step, the parameters (trainable, frozen,
tied, buffers), the optimizer state and its param groups, the non-tensor items grouped by
top-level key, the files. verify: every rank file present and a readable zip whose pickle
passes the allow-list, every storage inside its file and matching the zip's CRC-32, every
parameter covered exactly once by the partitions (each element by one piece).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from ...errors import DataCheckError
from ..format.bytecopy import SourceTensor
from ..format.report import VerifyReport
from ..torchfile.savefile import verify_saved_files
from ..torchfile.unpickler import count_items
from .table import FORMAT, open_deepspeed

LARGEST = 5
PARAM_GROUPS_ITEM = "optimizer.param_groups"  # the optimizer's hyperparameters, one item per group setting


def _tensor(source: SourceTensor) -> dict:
    return {"name": source.name, "dtype": source.dtype, "shape": list(source.shape), "bytes": source.nbytes}


def summarize_deepspeed(path: str | os.PathLike[str]) -> dict:
    with open_deepspeed(path) as checkpoint:
        model = [_tensor(s) for s in checkpoint.model]
        optim = checkpoint.optimizer
        trainable = len(model) - len(checkpoint.frozen) - len(checkpoint.buffers)
        return {
            "path": str(checkpoint.directory),
            "format": FORMAT,
            "tag": checkpoint.files.tag,
            "stage": checkpoint.stage,
            "precision": checkpoint.precision,
            "world_size": checkpoint.world_size,
            "ds_version": checkpoint.ds_version,
            "global_steps": checkpoint.global_steps,
            "model": {
                "tensors": len(model),
                "trainable": trainable,
                "frozen": list(checkpoint.frozen),
                "buffers": list(checkpoint.buffers),
                "tied": checkpoint.aliases,
                "elements": sum(s.numel for s in checkpoint.model),
                "bytes": sum(t["bytes"] for t in model),
            },
            "optimizer": {
                "tensors": len(optim),
                "states": sorted(Counter(s.name.split(".")[1] for s in optim)),
                "bytes": sum(s.nbytes for s in optim),
                "param_groups": checkpoint.param_groups,
            },
            "dtypes": dict(Counter(s.dtype for s in checkpoint.sources)),
            "largest": sorted(model, key=lambda t: t["bytes"], reverse=True)[:LARGEST],
            "tensors": model + [_tensor(s) for s in optim],
            "items": {key: count_items(value) for key, value in {**checkpoint.items, PARAM_GROUPS_ITEM: checkpoint.param_groups}.items()},
            "files": [{"name": rf.path.name, "size": rf.size} for rf in checkpoint.opened],
        }


def verify_deepspeed(path: str | os.PathLike[str]) -> VerifyReport:
    report = VerifyReport(str(path), FORMAT)
    try:
        checkpoint = open_deepspeed(Path(path))
    except DataCheckError as error:
        return report.failed(str(error))
    with checkpoint:
        verify_saved_files(report, checkpoint.directory, checkpoint.sources, checkpoint.opened)
        report.checked = [
            f"{len(checkpoint.opened)} rank files present ({checkpoint.world_size} ranks), each a readable zip",
            *report.checked,
            "every parameter and optimizer state covered exactly once by the partitions",
        ]
    return report
