"""Full (Hugging Face style) safetensors checkpoints as a `Format` (core/protocol.py): one
`.safetensors` file, an index, or a directory of them (with `optimizer*` files), opened as a
tensor table, inspected, verified (headers, sizes, the index: the format has no checksums) and
written (`to_full`); a full checkpoint has no ranks, so it is never resharded. It lives beside
fsdpkit's own format because it shares that format's safetensors reader, header parser, writer
and export layout. Importing it imports only the table's facts: each method imports what it needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from .names import MANIFEST_NAME

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint
    from ..core.report import VerifyReport, WriteReport
    from ..core.summary import FullSummary


class FullFormat:
    name = "full"
    label = "full safetensors"
    reads = Options()
    writes = Options(takes=("model", "max_shard_size", "cast_to", "with_optimizer"))
    writable = True
    reshardable = False

    def detect(self, path: Path) -> bool:
        from .reader import is_full_checkpoint

        return is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists())

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        from ..core.any_checkpoint import AnyCheckpoint, item_readers, split_model_optimizer
        from .reader import has_optimizer_files, open_full
        from .to_full import restore_layout

        full = open_full(path, with_optimizer=path.is_dir() and has_optimizer_files(path))
        model, optimizer = split_model_optimizer(list(full.tensors), full.aliases)
        opened = AnyCheckpoint(
            str(path), model, optimizer, aliases=dict(full.aliases), export_layout=full.layout, items=item_readers(full.metadata)
        )
        if full.layout is not None and not full.layout.is_identity:
            layout = full.layout
            opened.restore_layout = lambda scratch, chunk_size: restore_layout(
                opened.stored(), opened.aliases, layout, path, scratch, chunk_size=chunk_size
            )
        return opened

    def inspect(self, path: Path, keys: Keys) -> FullSummary:
        from .verify import summarize_full

        return summarize_full(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        from .verify import verify_full

        return verify_full(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        from .to_full import to_full

        return to_full(opened, dst, request, progress)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        raise UsageError(f"{src}: a {self.label} checkpoint has no ranks to lay out")
