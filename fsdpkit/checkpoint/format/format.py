"""fsdpkit's own sharded checkpoints as a `Format` (core/protocol.py): a step directory (its
manifest) or a run directory (`latest`, or step-* directories), opened as a tensor table with the
training state, inspected, verified fragment by fragment, written (`to_sharded`) and resharded.
Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from .names import LATEST_NAME, MANIFEST_NAME, parse_step_dir_name

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from ..core.summary import ShardedSummary


class ShardedFormat:
    name = "sharded"
    label = "fsdpkit"
    reads = Options()
    writes = Options(
        needs=("world_size",),
        takes=("model", "cast_to", "with_optimizer"),
        why="--model names the model whose flat-parameter layout to write, default an even split per tensor;"
        " the optimizer state goes with it",
    )
    writable = True
    reshardable = True

    def detect(self, path: Path) -> bool:
        """A step directory (its manifest), or a run directory (`latest`, or step-* directories)."""
        if not path.is_dir():
            return False
        if (path / MANIFEST_NAME).exists() or (path / LATEST_NAME).exists():
            return True
        return any(parse_step_dir_name(child.name) is not None for child in path.iterdir())

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        from ..core.any_checkpoint import AnyCheckpoint, item_readers, split_model_optimizer
        from ..core.export import export_of
        from .reader import open_sharded

        sharded = open_sharded(path)
        state = sharded.manifest.training_state
        model, optimizer = split_model_optimizer(sharded.sources(), sharded.manifest.aliases)
        return AnyCheckpoint(
            str(sharded.step_dir),
            model,
            optimizer,
            aliases=dict(sharded.manifest.aliases),
            items=item_readers(state),
            groups=(state.get("optimizer") or {}).get("groups") or [],
            step=int(state.get("step", 0) or 0),
            export=export_of(state, where=str(sharded.step_dir)),
            world_size=sharded.manifest.shard_factor,
        )

    def inspect(self, path: Path, keys: Keys) -> ShardedSummary:
        from .verify import summarize

        return summarize(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .verify import verify_checkpoint

        return verify_checkpoint(path, progress)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        from .to_sharded import to_sharded  # the writer: imported by --to sharded only

        return to_sharded(opened, dst, request, progress)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        from .to_sharded import reshard_sharded

        return reshard_sharded(src, dst, request)
