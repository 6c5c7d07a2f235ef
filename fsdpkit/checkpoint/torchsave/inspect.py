"""`fsdpkit inspect` and `fsdpkit verify` of per-rank `torch.save` state dicts, as JSON-able dicts."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..format.bytecopy import SourceTensor
from ..format.report import VerifyReport
from ..torchfile.savefile import verify_saved_files
from ..torchfile.unpickler import count_items
from .table import FORMAT, open_rank_state_dicts

LARGEST = 5


def _tensor(source: SourceTensor) -> dict[str, Any]:
    return {"name": source.name, "dtype": source.dtype, "shape": list(source.shape), "bytes": source.nbytes}


def summarize_torchsave(path: str | os.PathLike[str]) -> dict:
    with open_rank_state_dicts(path) as checkpoint:
        model = [_tensor(s) for s in checkpoint.model]
        optim = checkpoint.optim
        return {
            "path": str(checkpoint.directory),
            "format": FORMAT,
            "world_size": checkpoint.world_size,
            "sharding": checkpoint.sharding,
            "model": {"tensors": len(model), "elements": sum(s.numel for s in checkpoint.model), "bytes": sum(t["bytes"] for t in model)},
            "optimizer": {
                "tensors": len(optim.tensors),
                "states": sorted(Counter(s.name.split(".")[1] for s in optim.tensors)),
                "bytes": sum(s.nbytes for s in optim.tensors),
                "param_groups": optim.param_groups,
                "not_read": optim.not_read,
            },
            "dtypes": dict(Counter(s.dtype for s in checkpoint.model + optim.tensors)),
            "largest": sorted(model, key=lambda t: t["bytes"], reverse=True)[:LARGEST],
            "tensors": model + [_tensor(s) for s in optim.tensors],
            "items": {key: count_items(value) for key, value in checkpoint.extra_state.items()},
            "extra_state": checkpoint.extra_state,
            "not_read": checkpoint.other_files,
            "files": [{"name": rf.path.name, "size": rf.size} for rf in checkpoint.opened],
        }


def _why(not_read: str) -> str:
    return f" (optimizer files: {not_read})" if not_read else ""


def verify_torchsave(path: str | os.PathLike[str]) -> VerifyReport:
    report = VerifyReport(str(path), FORMAT)
    try:
        checkpoint = open_rank_state_dicts(Path(path))
    except DataCheckError as error:
        return report.failed(str(error))
    with checkpoint:
        verify_saved_files(report, checkpoint.directory, checkpoint.model + checkpoint.optimizer, checkpoint.opened)
        files = (
            f"{len(checkpoint.opened)} files present ({checkpoint.world_size} ranks' model files"
            + (", optimizer files" if checkpoint.optimizer else "")
            + (", extra state files" if checkpoint.extra_state else "")
            + "), each a readable zip"
        )
        report.checked = [
            files,
            *report.checked,
            "every tensor covered exactly once by the ranks' parts",
            f"not read: {', '.join(checkpoint.other_files) or 'nothing'}" + _why(checkpoint.optim.not_read),
        ]
    return report
