"""Megatron-Core `torch_dist` and NeMo 2 checkpoints as one of fsdpkit's formats: its name,
detection, summary and verification. Opening it as the table every format shares, and writing
it, are the offline layer's (`open_megatron_checkpoint`, `to_megatron`), as for DCP and DeepSpeed."""

from __future__ import annotations

import os
from pathlib import Path

from ..format.report import VerifyReport
from .files import is_megatron_checkpoint
from .inspect import FORMAT, MegatronSummary, summarize_megatron, verify_megatron


class MegatronFormat:
    name = FORMAT
    label = "Megatron"

    def detect(self, path: str | os.PathLike[str]) -> bool:
        return is_megatron_checkpoint(Path(path))

    def inspect(self, path: str | os.PathLike[str]) -> MegatronSummary:
        return summarize_megatron(path)

    def verify(self, path: str | os.PathLike[str]) -> VerifyReport:
        return verify_megatron(path)
