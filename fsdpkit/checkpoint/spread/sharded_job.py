"""`convert --to sharded` from another format, spread: fsdpkit's rank files, each written whole
by one rank from the source's byte ranges (cast as `--dtype` asks), the manifest written by rank
0 last. The output is `format.to_sharded`'s, byte for byte: the same tensors, layout and state."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from ...errors import DataCheckError
from ..core.crc import check_parts
from ..core.model_description import describe
from ..core.report import WriteReport
from ..core.request import ConvertRequest
from ..format.manifest import save_manifest
from ..format.to_sharded import restores_layout, sharded_output, sharded_source
from ..offline.formats import open_checkpoint
from .jobs import OneProcessOnly, Progress, RankFiles, convert_facts, part_reads, rank_file_part
from .plan import Part
from .staging import PartResult


class ShardedJob:
    command = "convert"

    def __init__(self, src: str, request: ConvertRequest):
        self.stack = ExitStack()
        self.opened = self.stack.enter_context(open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key))
        self.request = request
        try:
            if not self.opened.model:
                raise DataCheckError(f"{src}: no model tensors found")
            source = sharded_source(self.opened, request)
            description = describe(request.model) if request.model is not None else None
            if restores_layout(source, description):
                raise OneProcessOnly(
                    f"{src}: a full export in its own names and orientation is converted --to sharded in one process "
                    "(its transposed weights are transposed back into one scratch file)"
                )
            self.output = sharded_output(source, request, description, None)
        except BaseException:
            self.stack.close()
            raise
        self.rank_files = RankFiles.of(self.output.sources, self.output.manifest)
        self.files = self.rank_files.files()

    @property
    def source_bytes(self) -> int:
        return sum(s.nbytes for s in self.output.sources)

    def facts(self) -> dict:
        return convert_facts(self.request, self.opened.opened_from, [(f.name, f.nbytes) for f in self.files])

    def run_part(self, part: Part, directory: Path, progress: Progress) -> PartResult:
        return rank_file_part(part, directory / self.files[part.file].name, self.rank_files, self.request.chunk_size, progress)

    def commit(self, directory: Path, results: list[PartResult], dst: str) -> WriteReport:
        check_parts(part_reads(results))
        manifest = self.output.manifest
        save_manifest(directory, manifest)
        details = {"from": self.opened.format, **self.opened.facts, **self.output.details}
        files, nbytes = [f.name for f in self.files], sum(t.nbytes for t in manifest.tensors)
        return WriteReport(self.opened.path, dst, files, len(manifest.tensors), nbytes, [], details)

    def close(self) -> None:
        self.stack.close()
