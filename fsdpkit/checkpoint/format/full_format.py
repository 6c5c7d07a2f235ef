"""Full (Hugging Face style) safetensors checkpoints as a `Format` (core/protocol.py): one
`.safetensors` file, an index, or a directory of them (with `optimizer*` files), opened as a
tensor table, inspected, verified (headers, sizes, the index: the format has no checksums) and
written (`to_full`); a full checkpoint has no ranks, so it is never resharded. It lives beside
fsdpkit's own format because it shares that format's safetensors reader, header parser, writer
and export layout."""

from __future__ import annotations

from pathlib import Path

from ...errors import UsageError
from ..core.any_checkpoint import AnyCheckpoint, item_readers, split_model_optimizer
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest, Keys, Options, Progress, ReshardRequest
from ..core.summary import FullSummary
from .names import MANIFEST_NAME
from .reader import is_full_checkpoint
from .to_full import to_full
from .verify import summarize_full, verify_full


class FullFormat:
    name = "full"
    label = "full safetensors"
    reads = Options()
    writes = Options(takes=("model", "max_shard_size", "cast_to", "with_optimizer"))
    writable = True
    reshardable = False

    def detect(self, path: Path) -> bool:
        return is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists())

    def open(self, path: Path, keys: Keys) -> AnyCheckpoint:
        from .reader import has_optimizer_files, open_full

        full = open_full(path, with_optimizer=path.is_dir() and has_optimizer_files(path))
        model, optimizer = split_model_optimizer(list(full.tensors), full.aliases)
        return AnyCheckpoint(
            str(path), model, optimizer, aliases=dict(full.aliases), export_layout=full.layout, items=item_readers(full.metadata)
        )

    def inspect(self, path: Path, keys: Keys) -> FullSummary:
        return summarize_full(path)

    def verify(self, path: Path, progress: Progress | None) -> VerifyReport:
        return verify_full(path)

    def write(self, opened: AnyCheckpoint, dst: Path, request: ConvertRequest, progress: Progress | None) -> WriteReport:
        return to_full(opened, dst, request, progress)

    def reshard(self, src: Path, dst: Path, request: ReshardRequest) -> WriteReport:
        raise UsageError(f"{src}: a {self.label} checkpoint has no ranks to lay out")
