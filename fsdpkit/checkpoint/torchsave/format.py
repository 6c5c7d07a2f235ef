"""verl's per-rank `torch.save` files as a `Format` (core/protocol.py): read, inspected and
verified, never written (`convert` writes them out in the other formats) and never resharded.
Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from .inspect import TorchSaveSummary


class TorchSaveFormat:
    name = "torch-save-ranks"
    label = "verl"
    reads = Options()
    writes = Options()
    writable = False
    reshardable = False

    def detect(self, path: Path) -> bool:
        from .table import is_torchsave_checkpoint

        return is_torchsave_checkpoint(path)

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        from ..core.any_checkpoint import AnyCheckpoint, item_readers, steps_taken
        from ..core.names import split_optim_tensor_name
        from .table import open_rank_state_dicts

        checkpoint = open_rank_state_dicts(path)
        optimizer = {t.name: t for t in checkpoint.optim.tensors}
        items = item_readers(checkpoint.extra_state)
        groups = []
        if optimizer:
            items |= item_readers({"optimizer.param_groups": checkpoint.optim.param_groups})
            # verl's one group holds every parameter the optimizer files hold state of
            params = list(dict.fromkeys(split[1] for name in optimizer if (split := split_optim_tensor_name(name))))
            groups = [{"settings": settings, "params": params} for settings in checkpoint.optim.param_groups]
        return AnyCheckpoint(
            str(checkpoint.directory),
            {t.name: t for t in checkpoint.model},
            optimizer,
            items=items,
            groups=groups,
            step=steps_taken(checkpoint.optim.tensors),
            world_size=checkpoint.world_size,
            facts={"from_world_size": checkpoint.world_size, "not_read": checkpoint.other_files},
            _close=checkpoint.close,
        )

    def inspect(self, path: Path, keys: Keys) -> TorchSaveSummary:
        from .inspect import summarize_torchsave

        return summarize_torchsave(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .inspect import verify_torchsave

        return verify_torchsave(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        raise UsageError(f"{dst}: fsdpkit does not write {self.label} checkpoints")

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        raise UsageError(f"{src}: a {self.label} checkpoint has no ranks to lay out")
