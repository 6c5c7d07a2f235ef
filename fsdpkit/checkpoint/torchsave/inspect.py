"""`fsdpkit inspect` and `fsdpkit verify` of per-rank `torch.save` state dicts, as JSON-able dicts."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..deepspeed.inspect import coverage_problems
from ..deepspeed.rankfile import crc_problems_of
from .table import FORMAT, open_rank_state_dicts

LARGEST = 5


def summarize_torchsave(path: str | os.PathLike[str]) -> dict:
    with open_rank_state_dicts(path) as checkpoint:
        model: list[dict[str, Any]] = [
            {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "bytes": s.nbytes} for s in checkpoint.model
        ]
        return {
            "path": str(checkpoint.directory),
            "format": FORMAT,
            "world_size": checkpoint.world_size,
            "model": {"tensors": len(model), "elements": sum(s.numel for s in checkpoint.model), "bytes": sum(t["bytes"] for t in model)},
            "dtypes": dict(Counter(s.dtype for s in checkpoint.model)),
            "largest": sorted(model, key=lambda t: t["bytes"], reverse=True)[:LARGEST],
            "tensors": model,
            "not_read": checkpoint.other_files,
            "files": [{"name": rf.path.name, "size": rf.size} for rf in checkpoint.opened],
        }


def verify_torchsave(path: str | os.PathLike[str]) -> dict:
    report: dict[str, Any] = {"path": str(path), "kind": FORMAT, "ok": False, "problems": [], "tensors": 0, "bytes": 0, "checked": []}
    try:
        checkpoint = open_rank_state_dicts(Path(path))
    except DataCheckError as error:
        report["problems"].append(str(error))
        return report
    with checkpoint:
        problems = coverage_problems(checkpoint.directory, checkpoint.model)
        storages, found = crc_problems_of(checkpoint.opened)
        problems.extend(found)
        report.update(
            ok=not problems,
            problems=problems,
            tensors=len(checkpoint.model),
            files=len(checkpoint.opened),
            bytes=sum(s.nbytes for s in checkpoint.model),
            checked=[
                f"{len(checkpoint.opened)} model files present ({checkpoint.world_size} ranks), each a readable zip",
                "every data.pkl through the allow-list unpickler",
                "every tensor inside its storage",
                f"{storages} storages against the zip's CRC-32",
                "every tensor covered exactly once by the ranks' parts",
                f"not read: {', '.join(checkpoint.other_files) or 'nothing'}",
            ],
        )
    return report
