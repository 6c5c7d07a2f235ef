"""`convert --to dcp` and `--to megatron` (DCP underneath) from another format, spread: the `__<rank>_0.distcp` files of
`dcp.writer.plan_dcp`'s plan, each written by one rank or cut by byte range into parts (at any
element boundary of a chunk's data; the archives' headers and the bytes items are known before
any data is read), `.metadata` (and Megatron's common files) written by rank 0 last. The output
is the one-process writer's, byte for byte."""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..core.any_checkpoint import recorded_data_source
from ..core.bytecopy import SourcePiece
from ..core.crc import check_parts
from ..core.report import WriteReport
from ..core.request import ConvertRequest
from ..dcp.export import dcp_entries
from ..dcp.metadata import METADATA_NAME
from ..dcp.table import open_dcp
from ..dcp.writer import DcpPlan, DcpRecord, OutBytes, OutTensor, plan_dcp, rank_file_name
from ..megatron.to_megatron import SCRATCH_NAME, megatron_output
from ..megatron.transposed import write_transposed
from ..offline.formats import open_checkpoint
from ..offline.locations import source_at
from .jobs import CheckedReads, OneProcessOnly, Progress, convert_facts, part_reads, source_listing
from .plan import OutputFile, Part
from .staging import PartResult
from .writes import PartSink, StreamSink


def dcp_file(name: str, records: list[DcpRecord], nbytes: int) -> OutputFile:
    """A rank file that may be cut at any element boundary of a chunk's data."""
    cuts = tuple(
        (r.data_begin, r.data_end, dtype_info(r.chunk.tensor.source.dtype).itemsize)
        for r in records
        if r.chunk is not None and r.data_end > r.data_begin
    )
    return OutputFile(name, nbytes, cuts)


def _literal(sink: PartSink | StreamSink, data: bytes, at: int, part: Part) -> None:
    """The bytes of `data`, which lies at byte `at` of the file, that fall in `part`."""
    lo, hi = max(part.begin, at), min(part.end, at + len(data))
    if lo < hi:
        sink.write(memoryview(data)[lo - at : hi - at])


class DcpJob:
    """`convert --to dcp`; `entries` and `commit_files` are what `--to megatron` and `reshard` change."""

    command = "convert"

    def __init__(self, src: str, request: ConvertRequest):
        self.stack = ExitStack()
        self.src, self.request = src, request
        try:
            tensors, items, world_size = self.entries(src, request)
            self.plan = plan_dcp(tensors, items, world_size=world_size)
        except BaseException:
            self.stack.close()
            raise
        self.files = [dcp_file(rank_file_name(r), records, self.plan.file_size(r)) for r, records in enumerate(self.plan.ranks)]

    def entries(self, src: str, request: ConvertRequest) -> tuple[list[OutTensor], list[OutBytes], int]:
        """The source opened (closed with `stack`): the tensors and bytes items written, and the world size they are chunked for."""
        self.opened = opened = self.stack.enter_context(
            open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key)
        )
        if not opened.model:
            raise DataCheckError(f"{src}: no model tensors found")
        if opened.restore_layout is not None:
            raise OneProcessOnly(
                f"{src}: a full export in its own names and orientation is converted --to dcp in one process "
                "(its transposed weights are transposed back into one scratch file)"
            )
        data_source = recorded_data_source(opened)
        tensors, items = dcp_entries(opened.stored(), aliases=opened.aliases, groups=opened.groups, data_source=data_source)
        return tensors, items, request.world_size or 1

    @property
    def source_bytes(self) -> int:
        return sum(t.source.nbytes for t in self.plan.tensors)

    def facts(self) -> dict:
        return convert_facts(self.request, self.opened.opened_from, [(f.name, f.nbytes) for f in self.files])

    def run_part(self, part: Part, directory: Path, progress: Progress) -> PartResult:
        with PartSink(directory / self.files[part.file].name, part.begin, part.end) as sink:
            return self.write_part(part, sink, progress)

    def write_part(self, part: Part, sink: PartSink | StreamSink, progress: Progress) -> PartResult:
        """Bytes [part.begin, part.end) of file `part.file`, in offset order, into `sink`."""
        return self.write_planned(self.plan, part, sink, progress)

    def write_planned(self, plan: DcpPlan, part: Part, sink: PartSink | StreamSink, progress: Progress) -> PartResult:
        """Bytes [part.begin, part.end) of `plan`'s file `part.file`, in offset order, into `sink`."""
        reads = CheckedReads(self.request.chunk_size, progress)
        try:
            for record in plan.ranks[part.file]:
                if record.position >= part.end or record.position + record.length <= part.begin:
                    continue
                if record.chunk is None:
                    assert record.item is not None
                    _literal(sink, record.item, record.position, part)
                    continue
                head, tail = record.chunk.archive()
                _literal(sink, head, record.position, part)
                lo, hi = max(part.begin, record.data_begin), min(part.end, record.data_end)
                if lo < hi:
                    source, wanted = record.chunk.tensor.source, record.chunk.wanted
                    itemsize = dtype_info(source.dtype).itemsize
                    first, last = (lo - record.data_begin) // itemsize, (hi - record.data_begin) // itemsize
                    reads.copy(source, ElementRange(wanted.start + first, wanted.start + last), source.dtype, sink.write)
                _literal(sink, tail, record.data_end, part)
        finally:
            source_parts = reads.finish()
        name = self.files[part.file].name
        return PartResult(part.file, part.index, name, part.begin, part.end, sink.crc, reads.bytes_read, source_parts)

    def commit(self, directory: Path, results: list[PartResult], dst: str) -> WriteReport:
        check_parts(part_reads(results))
        (directory / METADATA_NAME).write_bytes(self.plan.metadata_bytes())  # the staging area's commit syncs it
        return self.commit_files(directory, dst)

    def commit_files(self, directory: Path, dst: str) -> WriteReport:
        """What is written after `.metadata`, and the report."""
        details = {"from": self.opened.format, **self.opened.facts, "to": "dcp", "world_size": len(self.files)}
        details["param_groups"] = len(self.opened.groups)
        files = [f.name for f in self.files]
        return WriteReport(self.opened.opened_from, dst, files, len(self.plan.tensors), self.source_bytes, [], details)

    def close(self) -> None:
        self.stack.close()


def _pieces_in(record: DcpRecord, part: Part) -> list[SourcePiece]:
    """The source pieces the data of `record` that falls in `part` is read from."""
    lo, hi = max(part.begin, record.data_begin), min(part.end, record.data_end)
    if record.chunk is None or lo >= hi:
        return []
    source, wanted = record.chunk.tensor.source, record.chunk.wanted
    itemsize = dtype_info(source.dtype).itemsize
    first, last = (lo - record.data_begin) // itemsize, (hi - record.data_begin) // itemsize
    return source.pieces_in(ElementRange(wanted.start + first, wanted.start + last))


class MegatronJob(DcpJob):
    """`convert --to megatron`: DCP's one rank file (cut by byte range; transformers' GPT-2 Conv1D
    weights transposed by the rank that writes them), then `.metadata`, `common.pt` and
    `metadata.json` by rank 0."""

    def entries(self, src: str, request: ConvertRequest) -> tuple[list[OutTensor], list[OutBytes], int]:
        self.opened = opened = self.stack.enter_context(open_checkpoint(src))
        if not opened.model:
            raise DataCheckError(f"{src}: no model tensors found")
        self.output = megatron_output(opened, request, Path(SCRATCH_NAME))
        return self.output.tensors, self.output.items, 1

    def write_part(self, part: Part, sink: PartSink | StreamSink, progress: Progress) -> PartResult:
        """transformers' GPT-2 Conv1D weights, (in, out), are read transposed from a scratch file of
        this rank's own in a temporary directory, holding only those that this part's byte range
        takes (by blocks of a weight's rows, as in one process), removed when the part is written."""
        if not self.output.flipped:
            return super().write_part(part, sink, progress)
        with tempfile.TemporaryDirectory(prefix="fsdpkit-transposed-") as directory:
            scratch = Path(directory) / SCRATCH_NAME
            output = megatron_output(self.opened, self.request, scratch)
            plan = plan_dcp(output.tensors, output.items, world_size=1)
            taken = {p.key for record in plan.ranks[part.file] for p in _pieces_in(record, part) if p.path == scratch}
            write_transposed(scratch, output.flipped, self.request.chunk_size, only=taken)
            return self.write_planned(plan, part, sink, progress)

    def commit_files(self, directory: Path, dst: str) -> WriteReport:
        files = [*(f.name for f in self.files), METADATA_NAME, *self.output.write_common(directory)]
        details = {"from": self.opened.format, **self.opened.facts, "to": "megatron", "shape": self.output.shape.to_json()}
        return WriteReport(self.opened.path, dst, files, len(self.output.tensors), self.output.nbytes, [], details)


class DcpReshardJob(DcpJob):
    """`reshard` of a DCP checkpoint: every item kept (bytes items byte for byte), chunked as FSDP2 at `world_size` ranks."""

    command = "reshard"

    def __init__(self, src: str, world_size: int, chunk_size: int):
        super().__init__(src, ConvertRequest(to="dcp", world_size=world_size, chunk_size=chunk_size))

    def entries(self, src: str, request: ConvertRequest) -> tuple[list[OutTensor], list[OutBytes], int]:
        assert request.world_size is not None
        checkpoint = self.stack.enter_context(open_dcp(source_at(src)))
        metadata = checkpoint.metadata
        tensors = [OutTensor(metadata.paths.get(key) or (key,), checkpoint.source(key)) for key in metadata.tensors]
        items = [OutBytes(metadata.paths.get(key) or (key,), partial(checkpoint.read_bytes_item, key)) for key in metadata.bytes_items]
        return tensors, items, request.world_size

    def facts(self) -> dict:
        files = [(f.name, f.nbytes) for f in self.files]
        return {"command": "reshard", "world_size": len(self.files), "source": source_listing(self.src), "files": files}

    def commit_files(self, directory: Path, dst: str) -> WriteReport:
        details = {"to": "dcp", "world_size": len(self.files), "bytes_items": len(self.plan.items)}
        files = [f.name for f in self.files]
        return WriteReport(str(self.src), dst, files, len(self.plan.tensors), self.source_bytes, [], details)
