"""`convert --to deepspeed` from another format, and `reshard` of a DeepSpeed checkpoint, spread:
the tag directory's files of `deepspeed.writer.deepspeed_files` (each a torch zip of one rank's
model or optimizer states, whose records are known before any data is read), each written by
one rank or cut by byte range inside its storages' data, `latest` written by rank 0 last. The
output is the one-process writer's, byte for byte: a file cut into parts gets its storages'
CRC-32s (each part's share combined) written into its zip's data descriptors and central
directory by rank 0 at the commit."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourceTensor
from ..core.crc import check_parts, crc32, crc32_combine
from ..core.files import write_views
from ..core.report import WriteReport
from ..core.request import ConvertRequest
from ..core.staging import fsync_dir
from ..deepspeed.table import open_deepspeed
from ..deepspeed.to_deepspeed import RunShape, build_run, resharded_run
from ..deepspeed.writer import DsFile, DsRun, deepspeed_files
from ..offline.formats import open_checkpoint
from ..offline.locations import source_at
from .jobs import CheckedReads, Progress, convert_facts, part_reads, source_listing
from .plan import OutputFile, Part
from .staging import PartResult
from .writes import PartSink, StreamSink

LATEST = "latest"
CUT_STEP = 4  # a part of a DeepSpeed file starts at a multiple of 4 bytes into a storage's data


class RangeOutput:
    """A file's contents, appended from its start as the DeepSpeed writer does, of which only
    bytes [sink's begin, end) reach `sink`; storage elements outside them are not read."""

    def __init__(self, sink: PartSink | StreamSink, reads: CheckedReads, begin: int, end: int):
        self.path, self.position = sink.path, 0
        self.sink, self.reads, self.begin, self.end = sink, reads, begin, end
        self.record_crcs: list[list[int]] = []  # [begin, end, CRC-32] of each storage's bytes this part holds
        self._kept: list[int] | None = None  # the one being written (begin -1: none in this part yet)

    def start_crc(self) -> None:
        self._kept = [-1, -1, 0]

    def crc(self) -> int:
        """The CRC-32 of the storage's bytes in this part (the whole storage's when it holds them all)."""
        kept, self._kept = self._kept, None
        if kept is None:
            raise AssertionError(f"{self.path}: crc() without start_crc()")
        if kept[0] >= 0:
            self.record_crcs.append(kept)
        return kept[2]

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        lo, hi = max(self.begin, self.position), min(self.end, self.position + view.nbytes)
        if lo < hi:
            held = view[lo - self.position : hi - self.position]
            self.sink.write(held)
            if self._kept is not None:
                self._kept[0] = lo if self._kept[0] < 0 else self._kept[0]
                self._kept[1:] = [hi, crc32(held, self._kept[2])]
        self.position += view.nbytes

    def copy(self, source: SourceTensor, wanted: ElementRange) -> None:
        self.copy_via_engine(source, wanted, source.dtype)

    def copy_via_engine(self, source: SourceTensor, wanted: ElementRange, dtype: str) -> None:
        itemsize = dtype_info(dtype).itemsize
        start, nbytes = self.position, wanted.size * itemsize
        lo, hi = max(self.begin, start), min(self.end, start + nbytes)
        if lo < hi:  # the elements that hold bytes [lo, hi), the first and last cut by `write`
            first, last = (lo - start) // itemsize, -(-(hi - start) // itemsize)
            self.position = start + first * itemsize
            self.reads.copy(source, ElementRange(wanted.start + first, wanted.start + last), dtype, self.write)
        self.position = start + nbytes


def write_crcs(path: Path, file: DsFile, parts: list[PartResult]) -> None:
    """The storages' CRC-32s of `file` (at `path`, written by `parts`), each combined from the
    parts' shares, written into its data descriptors and central directory, synced."""
    shares = sorted(tuple(share) for part in parts for share in part.record_crcs)
    crcs = []
    for begin, end in file.data_spans():
        crc, at = 0, begin
        for lo, hi, value in (share for share in shares if begin <= share[0] < end):
            if lo != at:
                raise AssertionError(f"{path}: bytes [{at}, {lo}) of a storage have no CRC-32")
            crc, at = crc32_combine(crc, value, hi - lo), hi
        if at != end:
            raise AssertionError(f"{path}: a storage's CRC-32 covers bytes up to {at}, not {end}")
        crcs.append(crc)
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, bytes_around in file.parts(crcs):
            write_views(fd, [bytes_around], path, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


class DeepSpeedJob:
    command = "convert"

    def __init__(self, src: str, request: ConvertRequest):
        self.stack = ExitStack()
        self.src, self.request = src, request
        try:
            self.run = self.build(src, request)
            self.contents = deepspeed_files(self.run)
        except BaseException:
            self.stack.close()
            raise
        self.files = [OutputFile(f"{self.run.tag}/{file.name}", file.nbytes, file.storage_spans(CUT_STEP)) for file in self.contents]

    def build(self, src: str, request: ConvertRequest) -> DsRun:
        """The source opened (closed with `stack`), and the run written."""
        assert request.stage is not None  # check_options: --to deepspeed needs it
        self.opened = opened = self.stack.enter_context(
            open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key)
        )
        if not opened.model:
            raise DataCheckError(f"{src}: no model tensors found")
        tensors = {t.name: t for t in opened.stored()}
        return build_run(
            tensors, opened.groups, RunShape(request.stage, request.world_size or opened.world_size, opened.step, opened.aliases)
        )

    @property
    def source_bytes(self) -> int:
        return sum(p.master.nbytes * 3 for g in self.run.groups for p in g.params)

    def facts(self) -> dict:
        return convert_facts(self.request, self.opened.opened_from, [(f.name, f.nbytes) for f in self.files])

    def run_part(self, part: Part, directory: Path, progress: Progress) -> PartResult:
        (directory / self.run.tag).mkdir(exist_ok=True)
        with PartSink(directory / self.files[part.file].name, part.begin, part.end) as sink:
            return self.write_part(part, sink, progress)

    def write_part(self, part: Part, sink: PartSink | StreamSink, progress: Progress) -> PartResult:
        """Bytes [part.begin, part.end) of file `part.file`, in offset order, into `sink`."""
        reads = CheckedReads(self.request.chunk_size, progress)
        output = RangeOutput(sink, reads, part.begin, part.end)
        try:
            self.contents[part.file].write(output)
        finally:
            source_parts = reads.finish()
        name = self.files[part.file].name
        crcs = output.record_crcs
        return PartResult(part.file, part.index, name, part.begin, part.end, sink.crc, reads.bytes_read, source_parts, record_crcs=crcs)

    def commit(self, directory: Path, results: list[PartResult], dst: str) -> WriteReport:
        check_parts(part_reads(results))
        for index in sorted({result.file for result in results}):
            cut = [result for result in results if result.file == index]
            if len(cut) > 1:  # each part wrote the CRC-32s of its own share of a storage
                write_crcs(directory / self.files[index].name, self.contents[index], cut)
        (directory / LATEST).write_text(self.run.tag)  # the staging area's commit syncs it
        (directory / self.run.tag).mkdir(exist_ok=True)  # a bucket's rank 0 may have written none of its files
        fsync_dir(directory / self.run.tag)
        run = self.run
        details = {"to": "deepspeed", "stage": run.stage, "world_size": run.world_size, "tag": run.tag}
        parameters = sum(len(g.params) for g in run.groups)
        files = [LATEST, *(f.name for f in self.files)]
        return WriteReport(str(self.src), dst, files, parameters, self.source_bytes, [], self.source_details() | details)

    def source_details(self) -> dict:
        return {"from": self.opened.format, **self.opened.facts}

    def close(self) -> None:
        self.stack.close()


class DeepSpeedReshardJob(DeepSpeedJob):
    """`reshard` of a DeepSpeed checkpoint: the same run laid out for `world_size` ranks."""

    command = "reshard"

    def __init__(self, src: str, world_size: int, chunk_size: int):
        super().__init__(src, ConvertRequest(to="deepspeed", world_size=world_size, chunk_size=chunk_size))

    def build(self, src: str, request: ConvertRequest) -> DsRun:
        assert request.world_size is not None
        return resharded_run(self.stack.enter_context(open_deepspeed(source_at(src))), request.world_size)

    def facts(self) -> dict:
        files = [(f.name, f.nbytes) for f in self.files]
        return {"command": "reshard", "world_size": self.run.world_size, "source": source_listing(self.src), "files": files}

    def source_details(self) -> dict:
        return {}
