"""DCP as a `Format` (core/protocol.py): a torch.distributed.checkpoint directory detected by its
`.metadata`, opened as a tensor table (FSDP2's and torchtitan's layouts, or the keys given),
inspected, verified, written in FSDP2's `{"model", "optimizer"}` layout and resharded.
Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from .inspect import DcpSummary


class DcpFormat:
    name = "dcp"
    label = "DCP"
    reads = Options(takes=("model_key", "optimizer_key"))
    writes = Options(takes=("world_size",), why="the optimizer state, when there is one, goes with it")
    writable = True
    reshardable = True

    def detect(self, path: Path) -> bool:
        from .metadata import is_dcp_checkpoint

        return is_dcp_checkpoint(path)

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        return open_dcp_checkpoint(path, keys)

    def inspect(self, path: Path, keys: Keys) -> DcpSummary:
        from .inspect import summarize_dcp

        return summarize_dcp(path, model_key=keys.model, optimizer_key=keys.optimizer)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .inspect import verify_dcp

        return verify_dcp(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        """FSDP2's `{"model", "optimizer"}` layout chunked for `--world-size` ranks (default 1): the
        model (tied names too, as FSDP2's state dict holds them), the optimizer state and its param groups.
        The names and orientation are the model's own: a full export's layout is undone, as `--to sharded`
        undoes it (its transposed weights transposed back in a scratch file beside `dst`, removed after)."""
        from ..core.any_checkpoint import recorded_data_source
        from ..core.names import SCRATCH_NAME
        from .export import DcpOutput, sources_to_dcp  # the writer: imported by --to dcp only

        output = DcpOutput(request.world_size or 1, request.chunk_size, request.overwrite)
        src, data_source = Path(opened.opened_from), recorded_data_source(opened)
        if opened.restore_layout is None:
            return sources_to_dcp(
                opened.stored(), src, dst, aliases=opened.aliases, groups=opened.groups, output=output, data_source=data_source
            )
        with tempfile.TemporaryDirectory(prefix=".fsdpkit-", dir=dst.parent) as scratch:
            sources, aliases = opened.restore_layout(Path(scratch) / SCRATCH_NAME, request.chunk_size)
            return sources_to_dcp(sources, src, dst, aliases=aliases, groups=opened.groups, output=output, data_source=data_source)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        from .export import reshard_dcp

        return reshard_dcp(src, dst, world_size=request.world_size, chunk_size=request.chunk_size, overwrite=request.overwrite)


def open_dcp_checkpoint(path: Path, keys: Keys) -> AnyCheckpoint:
    from ..core.any_checkpoint import AnyCheckpoint, steps_taken
    from .layout import detect_layout, layout_sources
    from .param_groups import plain_value, read_param_groups
    from .table import open_dcp

    checkpoint = open_dcp(path)
    try:
        layout = detect_layout(checkpoint.metadata, model_key=keys.model, optimizer_key=keys.optimizer)
        model, optimizer = layout_sources(checkpoint, layout)
        other = {key: checkpoint.source(key) for key in layout.other}
        groups = (
            read_param_groups(list(checkpoint.metadata.bytes_items), checkpoint.read_bytes_item, optimizer_key=layout.optimizer_key or "")
            if layout.optimizer
            else []
        )
    except BaseException:
        checkpoint.close()
        raise

    def item(key: str) -> Callable[[], Any]:
        return lambda: plain_value(checkpoint.read_bytes_item(key), where=f"{path}: bytes item {key!r}")

    return AnyCheckpoint(
        str(path),
        {t.name: t for t in model},
        {t.name: t for t in optimizer},
        other,
        items={key: item(key) for key in checkpoint.metadata.bytes_items},
        groups=groups,
        step=steps_taken(optimizer),
        facts={"model_key": layout.model_key},
        _close=checkpoint.close,
    )
