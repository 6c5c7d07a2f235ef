"""DCP as a `Format` (core/protocol.py): a torch.distributed.checkpoint directory detected by its
`.metadata`, opened as a tensor table (FSDP2's and torchtitan's layouts, or the keys given),
inspected, verified, written in FSDP2's `{"model", "optimizer"}` layout and resharded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core.any_checkpoint import AnyCheckpoint, steps_taken
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from .export import DcpOutput, reshard_dcp, sources_to_dcp
from .inspect import DcpSummary, summarize_dcp, verify_dcp
from .metadata import is_dcp_checkpoint


class DcpFormat:
    name = "dcp"
    label = "DCP"
    reads = Options(takes=("model_key", "optimizer_key"))
    writes = Options(takes=("world_size",), why="the optimizer state, when there is one, goes with it")
    writable = True
    reshardable = True

    def detect(self, path: Path) -> bool:
        return is_dcp_checkpoint(path)

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        return open_dcp_checkpoint(path, keys)

    def inspect(self, path: Path, keys: Keys) -> DcpSummary:
        return summarize_dcp(path, model_key=keys.model, optimizer_key=keys.optimizer)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        return verify_dcp(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        """FSDP2's `{"model", "optimizer"}` layout chunked for `--world-size` ranks (default 1): the
        model (tied names too, as FSDP2's state dict holds them), the optimizer state and its param groups."""
        output = DcpOutput(request.world_size or 1, request.chunk_size, request.overwrite)
        return sources_to_dcp(opened.stored(), Path(opened.opened_from), dst, aliases=opened.aliases, groups=opened.groups, output=output)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        return reshard_dcp(src, dst, world_size=request.world_size, chunk_size=request.chunk_size, overwrite=request.overwrite)


def open_dcp_checkpoint(path: Path, keys: Keys) -> AnyCheckpoint:
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
