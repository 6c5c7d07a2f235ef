"""What a spread command writes or checks, as output files of known size (`files`, which the plan
shares out), how one rank does one part of them (`run_part`) and rank 0's last step (`commit`):
here `convert --to full` from any format, `reshard` and `verify` of fsdpkit's own format, and
what the other jobs share (`dcp_job`, `deepspeed_job`, `sharded_job`, `diff_job`, `verify_jobs`; `dispatch`
picks one). Each rank opens the source itself (its headers and manifest, no tensor data) and
derives the same files; the runner checks that every rank derived the same ones.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.crc import PartRead, check_parts, crc32, crc32_combine
from ..core.names import layout_header
from ..core.report import VerifyReport, WriteReport
from ..core.request import ConvertRequest
from ..format.manifest import Manifest, load_manifest, resharded_training_state, save_manifest
from ..format.names import rank_file_name
from ..format.placement import ShardLayout, TensorSpec
from ..format.reader import ShardedCheckpoint, open_sharded
from ..format.storage import resolve_checkpoint
from ..format.to_full import FullOutput, full_output, transposed_bytes
from ..format.verify import check_files
from ..offline.formats import DEEPSPEED, open_checkpoint
from ..offline.locations import source_at
from ..storage.location import is_url, open_storage
from .plan import OutputFile, Part
from .scattered import Wanted, fill_and_send, reserved_spool, segments_of
from .staging import PartResult
from .writes import PartSink, StreamSink

if TYPE_CHECKING:
    from ..core.any_checkpoint import AnyCheckpoint

Progress = Callable[[int], None] | None


class OneProcessOnly(UsageError):
    """A conversion that only the one-process writer does (it needs a local scratch file), `why`:
    a command of one process in all, or under torchrun, runs it so (torchrun's rank 0 alone);
    with more processes of fsdpkit's own launch the line says to leave out the launch flags."""

    ADVICE = ": leave out the launch flags"

    def __init__(self, why: str):
        super().__init__(f"{why}{self.ADVICE}")
        self.why = why


def single_file_note(max_shard_size: int | None) -> str:
    """Why a single-file safetensors output is not cut, and what would cut it into files."""
    cut = "--max-shard-size cuts it" if max_shard_size is None else "it all fits in the --max-shard-size given: a smaller one cuts it"
    return f"a single-file safetensors output is written by one process ({cut} into files)"


def source_listing(path: str | os.PathLike[str]) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime in ns) of every file of a source: what the fingerprint of a
    conversion, and the check that every node sees the same source, rest on. An object-store
    URL's objects, listed, have no time here (0)."""
    if is_url(path):
        return sorted((name, size, 0) for name, size in open_storage(path).list().items())
    root = Path(path)
    found = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [(str(p.relative_to(root)) if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in found]


def convert_facts(request: ConvertRequest, opened_from: str, files: list[tuple[str, int]]) -> dict:
    """What a spread conversion's fingerprint rests on: the options, the source's listing, the output files."""
    options = {k: v for k, v in asdict(request).items() if k not in ("chunk_size", "overwrite")}
    return {"command": "convert", "request": options, "source": source_listing(opened_from), "files": files}


def part_reads(results: list[PartResult]) -> list[PartRead]:
    return [PartRead(Path(p[0]), *p[1:]) for result in results for p in result.source_parts]


def parts_json(parts: list[PartRead]) -> list[list]:
    return [[str(p.path), *p[1:]] for p in parts]


READ_BLOCK_BYTES = 8 * 1024 * 1024


class CheckedReads:
    """Element ranges of source tensors read as the one-process DCP and DeepSpeed writers read them
    (random access: a piece with a checksum is read whole and checked the first time any of it is
    wanted), so that a piece read by several parts, in any order, even twice (a tied weight), is
    checked without the parts having to meet end to end; the bytes wanted are counted and shown."""

    def __init__(self, chunk_size: int, progress: Progress):
        self.engine, self.progress, self.bytes_read = ByteEngine(chunk_size=chunk_size), progress, 0

    def copy(self, source: SourceTensor, wanted: ElementRange, dtype: str, write: Callable[[memoryview], None]) -> None:
        """Elements `wanted` of `source`, cast to `dtype`, into `write`."""
        itemsize = dtype_info(source.dtype).itemsize
        for data in self.engine.checked_blocks(source, wanted, dtype, READ_BLOCK_BYTES):
            write(data)
            nbytes = data.nbytes // dtype_info(dtype).itemsize * itemsize  # of the source
            self.bytes_read += nbytes
            if self.progress is not None:
                self.progress(nbytes)

    def finish(self) -> list[list]:
        """Close the files; what the commit checks (nothing: each piece was checked whole)."""
        return parts_json(self.engine.finish_parts())


def safetensors_file(name: str, header: bytes, order, *, whole: set[str], why_whole: str) -> OutputFile:
    """An output safetensors file of `header` and tensors `order` ((name, TensorInfo) in data
    order): cut at any element boundary unless `why_whole` says why not, but inside no tensor of `whole`."""
    splittable = not why_whole
    cuts = []
    for tensor, info in order:
        begin, end = len(header) + info.begin, len(header) + info.end
        if end > begin and splittable:
            cuts.append((begin, end, end - begin if tensor in whole else dtype_info(info.dtype).itemsize))
    size = len(header) + sum(info.nbytes for _, info in order)
    return OutputFile(name, size, tuple(cuts), why_whole)


class HandedFull(NamedTuple):
    """What a `FullJob` needs to write parts, as rank 0 opened it (plain data, no open file)."""

    src: str
    request: ConvertRequest
    opened_from: str
    output: FullOutput


class FullJob:
    """`convert --to full` from any format: one safetensors file per output file, cut by byte
    range into parts when there are several files (any element boundary of a tensor that is
    not transposed; a transposed one is read whole by the rank whose part starts it). Rank 0
    opens the source and hands what the other ranks of its node need (`hand_on`, `taken`)."""

    command = "convert"
    handed_from = (DEEPSPEED,)  # formats whose tensors are plain data, no reference to an opened file (`hand_on`)

    def __init__(self, src: str, request: ConvertRequest, handed: HandedFull | None = None):
        self.stack = ExitStack()
        self.opened: AnyCheckpoint | None = None
        if handed is None:
            self.opened = self.stack.enter_context(open_checkpoint(src, model_key=request.model_key, optimizer_key=request.optimizer_key))
            handed = HandedFull(src, request, str(self.opened.opened_from), full_output(self.opened, request))
        self.taken_from_rank_0 = self.opened is None
        self.src, self.request, self.opened_from, self.output = handed
        self.layouts = [layout_header(entries, metadata) for _, entries, metadata in self.output.files]
        why_whole = "" if len(self.layouts) > 1 else single_file_note(self.request.max_shard_size)
        named = zip(self.output.files, self.layouts, strict=True)
        whole = {name for name, (_, flip) in self.output.by_name.items() if flip}
        self.files = [safetensors_file(name, header, order, whole=whole, why_whole=why_whole) for (name, _, _), (header, order) in named]

    def hand_on(self) -> bytes | None:
        """What the other ranks of this node take instead of opening the source, pickled; None for
        a source in a bucket, or of a format not in `handed_from` (its tensors refer to its opened files)."""
        if is_url(self.src) or self.opened is None or self.opened.format not in self.handed_from:
            return None
        return pickle.dumps(HandedFull(self.src, self.request, self.opened_from, self.output), protocol=pickle.HIGHEST_PROTOCOL)

    @classmethod
    def taken(cls, handed: bytes) -> FullJob:
        state = pickle.loads(handed)
        return cls(state.src, state.request, state)

    @property
    def source_bytes(self) -> int:
        return self.output.source_bytes

    def facts(self) -> dict:
        return convert_facts(self.request, self.opened_from, self.file_sizes())

    def file_sizes(self) -> list[tuple[str, int]]:
        return [(f.name, f.nbytes) for f in self.files]

    def run_part(self, part: Part, directory: Path, progress: Progress) -> PartResult:
        with PartSink(directory / self.files[part.file].name, part.begin, part.end) as sink:
            return self.write_part(part, sink, progress)

    def write_part(self, part: Part, sink: PartSink | StreamSink, progress: Progress) -> PartResult:
        """Bytes [part.begin, part.end) of file `part.file`, in offset order, into `sink`."""
        header, order = self.layouts[part.file]
        name = self.files[part.file].name
        head = memoryview(header)[part.begin : min(part.end, len(header))]
        wanted, flips = [], []  # (source, its elements in the part, output dtype, where they go); transposed
        for tensor, info in order:
            lo, hi = max(part.begin, len(header) + info.begin), min(part.end, len(header) + info.end)
            if lo < hi:
                source, flip = self.output.by_name[tensor]
                itemsize = dtype_info(info.dtype).itemsize
                first, last = (lo - len(header) - info.begin) // itemsize, (hi - len(header) - info.begin) // itemsize
                wanted.append(Wanted(source, ElementRange(first, last), info.dtype, lo))
                flips.append(flip)
        segments = None if any(flips) else segments_of(wanted, part.begin)
        spool = reserved_spool(part.end - part.begin) if segments else None
        if segments and spool is not None:  # objects in a bucket: each read once, in its own order
            with spool:
                bytes_read = fill_and_send(spool.fileno(), segments, bytes(head), part.end - part.begin, sink.write, progress)
            return PartResult(part.file, part.index, name, part.begin, part.end, sink.crc, bytes_read, [])
        engine = ByteEngine(chunk_size=self.request.chunk_size, progress=progress)
        sink.write(head)
        reads = [(w.tensor, ElementRange(0, w.tensor.numel) if flip else w.elements) for w, flip in zip(wanted, flips, strict=True)]
        for index in engine.read_ahead(reads):
            (source, elements, dtype, _), flip = wanted[index], flips[index]
            if flip:
                itemsize = dtype_info(dtype).itemsize
                sink.write(
                    memoryview(transposed_bytes(engine, source, dtype)).cast("B")[elements.start * itemsize : elements.end * itemsize]
                )
            else:
                engine.copy(source, elements, dtype, sink.write)
        parts = engine.finish_parts()
        return PartResult(part.file, part.index, name, part.begin, part.end, sink.crc, engine.bytes_read, parts_json(parts))

    def commit(self, directory: Path, results: list[PartResult], dst: str) -> WriteReport:
        check_parts(part_reads(results))
        assert self.opened is not None, "the commit is rank 0's, which opened the source"
        written = self.output.report(self.output.commit_files(directory), src=self.opened.path, dst=Path(dst))
        details = {"from": self.opened.format, **self.opened.facts, **written.details}
        return replace(written, dst=dst if is_url(dst) else written.dst, details=details)  # a URL is no Path

    def close(self) -> None:
        self.stack.close()


@dataclass(frozen=True)
class RankFiles:
    """fsdpkit's rank files copied from `sources`, laid out by `layout`, cast to `dtypes` (one per source)."""

    sources: list[SourceTensor]
    layout: ShardLayout
    dtypes: list[str]

    @classmethod
    def of(cls, sources: list[SourceTensor], manifest: Manifest) -> RankFiles:
        return cls(sources, manifest.layout(), [t.dtype for t in manifest.tensors])

    def files(self) -> list[OutputFile]:
        world_size = self.layout.world_size
        return [OutputFile(rank_file_name(r, world_size), self.layout.file_layout(r).size) for r in range(world_size)]


def rank_file_part(part: Part, path: Path, rank_files: RankFiles, chunk_size: int, progress: Progress) -> PartResult:
    """Rank file `part.file` written whole at `path`."""
    layout = rank_files.layout.file_layout(part.file)
    engine = ByteEngine(rank_files.sources, rank_files.dtypes, chunk_size=chunk_size, progress=progress)
    try:
        crcs = engine.write_rank_file(path, layout)
    finally:
        parts = engine.finish_parts()
    crc = crc32(b"".join(layout.header_with(crcs)))
    for (start, end), fragment_crc in zip(layout.spans, crcs, strict=True):
        crc = crc32_combine(crc, fragment_crc, end - start)
    return PartResult(part.file, part.index, path.name, part.begin, part.end, crc, engine.bytes_read, parts_json(parts))


class ReshardJob:
    """`reshard` of fsdpkit's format: one rank file per output file, each written whole."""

    command = "reshard"

    def __init__(self, src: str, world_size: int, chunk_size: int):
        self.src, self.chunk_size = src, chunk_size
        self.checkpoint = open_sharded(source_at(src))
        old = self.checkpoint.manifest
        state, self.warnings = resharded_training_state(old.training_state, old_world_size=old.shard_factor, new_world_size=world_size)
        self.sources = self.checkpoint.sources()
        tensors = tuple(TensorSpec(s.name, s.dtype, tuple(s.shape)) for s in self.sources)
        self.manifest = Manifest(world_size, old.strategy, old.placement, tensors, dict(old.aliases), dict(state))
        self.rank_files = RankFiles.of(self.sources, self.manifest)
        self.files = self.rank_files.files()

    @property
    def source_bytes(self) -> int:
        return sum(s.nbytes for s in self.sources)

    def facts(self) -> dict:
        source = source_listing(self.src)
        return {"command": "reshard", "world_size": self.manifest.shard_factor, "source": source, "files": self.file_sizes()}

    def file_sizes(self) -> list[tuple[str, int]]:
        return [(f.name, f.nbytes) for f in self.files]

    def run_part(self, part: Part, directory: Path, progress: Progress) -> PartResult:
        return rank_file_part(part, directory / self.files[part.file].name, self.rank_files, self.chunk_size, progress)

    def commit(self, directory: Path, results: list[PartResult], dst: str) -> WriteReport:
        check_parts(part_reads(results))
        save_manifest(directory, self.manifest)
        old = self.checkpoint.manifest
        details = {"from_world_size": old.shard_factor, "world_size": self.manifest.shard_factor, "placement": old.placement.kind}
        files, tensors = [f.name for f in self.files], len(self.manifest.tensors)
        return WriteReport(
            str(self.checkpoint.step_dir), dst, files, tensors, sum(t.nbytes for t in self.manifest.tensors), self.warnings, details
        )

    def close(self) -> None:
        pass


class VerifyJob:
    """`verify` of fsdpkit's format: each rank file checked whole by one rank."""

    command = "verify"

    def __init__(self, src: str, chunk_size: int):
        step_dir = resolve_checkpoint(source_at(src))
        self.src, self.chunk_size = src, chunk_size
        self.checkpoint = ShardedCheckpoint(step_dir, load_manifest(step_dir))
        names = self.checkpoint.file_names()
        self.files = [OutputFile(name, _size(step_dir / name)) for name in names]

    @property
    def source_bytes(self) -> int:
        return sum(t.nbytes for t in self.checkpoint.manifest.tensors)

    def facts(self) -> dict:
        return {"command": "verify", "source": source_listing(str(self.checkpoint.step_dir))}  # a URL as its string

    def file_sizes(self) -> list[tuple[str, int]]:
        return [(f.name, f.nbytes) for f in self.files]

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        problems, fragments, checked = check_files(self.checkpoint, self.chunk_size, progress=progress, indices=[part.file])
        name = self.files[part.file].name
        return PartResult(part.file, part.index, name, part.begin, part.end, bytes_read=checked, problems=problems, fragments=fragments)

    def report(self, results: list[PartResult]) -> VerifyReport:
        manifest = self.checkpoint.manifest
        report = VerifyReport(str(self.checkpoint.step_dir), "sharded")
        problems = [line for result in sorted(results, key=lambda r: r.file) for line in result.problems]
        problems.extend(self.checkpoint.unexpected_files())
        fragments = sum(r.fragments for r in results)
        report.ok, report.problems, report.tensors = not problems, problems, len(manifest.tensors)
        report.bytes = sum(r.bytes_read for r in results)
        report.counts = {"fragment": fragments}
        report.checked = [f"the crc32 of all {fragments} fragments", "file sizes", "headers", "fragment coverage", "file names"]
        return report

    def close(self) -> None:
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
