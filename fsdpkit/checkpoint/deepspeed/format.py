"""DeepSpeed ZeRO as a `Format` (core/protocol.py): a save directory (its `latest` and tag) or one
tag's directory, opened as a tensor table with its Adam state, inspected, verified, written for a
ZeRO stage (`to_deepspeed`) and resharded for another world size.
Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from .inspect import DeepSpeedSummary


class DeepSpeedFormat:
    name = "deepspeed"
    label = "DeepSpeed"
    reads = Options()
    writes = Options(
        needs=("stage",),
        takes=("world_size",),
        why="DeepSpeed's ZeRO stage and ranks (default: the source's) to lay the fp32 weights and AdamW state out for",
    )
    writable = True
    reshardable = True

    def detect(self, path: Path) -> bool:
        from .files import is_deepspeed_checkpoint

        return is_deepspeed_checkpoint(path)

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        from ..core.any_checkpoint import AnyCheckpoint, item_readers, steps_taken, with_aliases
        from .table import open_deepspeed

        checkpoint = open_deepspeed(path)
        return AnyCheckpoint(
            str(checkpoint.directory),
            with_aliases({t.name: t for t in checkpoint.model}, checkpoint.aliases),
            {t.name: t for t in checkpoint.optimizer},
            aliases=dict(checkpoint.aliases),
            items=item_readers({**checkpoint.items, "optimizer.param_groups": checkpoint.param_groups}),
            groups=checkpoint.groups(),
            step=steps_taken(checkpoint.optimizer),
            world_size=checkpoint.world_size,
            facts={"stage": checkpoint.stage, "from_world_size": checkpoint.world_size},
            full_dtype="F32",
            _close=checkpoint.close,
        )

    def inspect(self, path: Path, keys: Keys) -> DeepSpeedSummary:
        from .inspect import summarize_deepspeed

        return summarize_deepspeed(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .inspect import verify_deepspeed

        return verify_deepspeed(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        from .to_deepspeed import to_deepspeed

        return to_deepspeed(opened, dst, request, progress)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        from .to_deepspeed import reshard_deepspeed

        return reshard_deepspeed(src, dst, world_size=request.world_size, overwrite=request.overwrite, progress=request.progress)
