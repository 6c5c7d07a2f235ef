"""`verify` of the formats other than fsdpkit's own, spread: the data files are the plan's units
(their bytes), checked by the ranks they fall to with the format's own check (DeepSpeed's and
verl's storages against the zip's CRC-32, DCP's and Megatron's chunk records, Megatron's SHA-256
of the files `integrity.json` lists). A file may be cut where a checked record starts (a storage,
a chunk's record), except a hashed one (SHA-256 runs front to back). A rank returns what it found
as JSON, each finding with its place in the one-process order, and rank 0 passes them to the
format's one-process verify, which checks the metadata itself and writes the one-process report.
A full safetensors checkpoint has no checksums (its headers are all verify reads): rank 0 reads
them, and there is nothing to share. A source that does not open plans no files: rank 0's
one-process verify reports it, as it does in one process. A source in an object store is read in
place by every rank (`source_at`), each fetching only the byte ranges of its own parts."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..core.files import source_path
from ..core.report import VerifyReport
from ..dcp.inspect import ChunkChecks, chunk_checks, verify_dcp
from ..dcp.metadata import METADATA_GLOBALS, read_metadata
from ..dcp.table import DcpCheckpoint
from ..deepspeed import inspect as deepspeed_inspect
from ..deepspeed.table import open_deepspeed
from ..format.verify import verify_full
from ..megatron.files import TORCH_DIST, find_files
from ..megatron.inspect import HASH_BLOCK, MegatronChecks, hash_problem, integrity_hashes, verify_megatron
from ..megatron.table import MEGATRON_METADATA_GLOBALS
from ..offline.locations import source_at
from ..torchsave import inspect as torchsave_inspect
from ..torchsave.table import open_rank_state_dicts
from .jobs import Progress, source_listing
from .plan import OutputFile, Part
from .staging import PartResult


class FileVerify:
    """What every verify job here shares: the source, its files as units, the fingerprint."""

    command = "verify"

    def __init__(self, src: str):
        self.src = src
        self.path = source_at(src)
        self.files: list[OutputFile] = []

    @property
    def source_bytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def facts(self) -> dict:
        return {"command": "verify", "source": source_listing(self.src)}

    def result(self, part: Part, found: Any, progress: Progress) -> PartResult:
        """Part `part` (one whole file) checked, `found` its findings as JSON."""
        nbytes = self.files[part.file].nbytes
        if progress is not None:
            progress(nbytes)
        name = self.files[part.file].name
        return PartResult(part.file, part.index, name, part.begin, part.end, bytes_read=nbytes, problems=[json.dumps(found)])

    def close(self) -> None:
        pass


def _findings(results: list[PartResult]) -> list[Any]:
    """What every part found, in file order."""
    return [json.loads(r.problems[0]) for r in sorted(results, key=lambda r: (r.file, r.index))]


def _unit(name: str, nbytes: int, starts: list[int]) -> OutputFile:
    """File `name`, which may be cut where any of `starts` (the offsets of checked records) is."""
    return OutputFile(name, nbytes, tuple((at, at, 1) for at in sorted(set(starts)) if 0 < at < nbytes))


def _sized(directory: Path, names: list[str], starts: dict[str, list[int]]) -> list[OutputFile]:
    units = []
    for name in names:
        try:
            units.append(_unit(name, (directory / name).stat().st_size, starts.get(name, [])))
        except OSError:
            units.append(OutputFile(name, 0))  # missing: the one-process checks say so
    return units


def _record_starts(checkpoint: DcpCheckpoint) -> dict[str, list[int]]:
    """The offset of every chunk's record, by file."""
    starts: dict[str, list[int]] = {}
    for tensor in checkpoint.metadata.tensors.values():
        for chunk in tensor.chunks:
            starts.setdefault(chunk.location.file, []).append(chunk.location.offset)
    return starts


SAVED_FILES: dict[str, tuple[Any, Any, Any, str]] = {
    "deepspeed": (open_deepspeed, deepspeed_inspect.verify_opened, deepspeed_inspect.verify_deepspeed, deepspeed_inspect.FORMAT),
    "torch-save-ranks": (
        open_rank_state_dicts,
        torchsave_inspect.verify_opened,
        torchsave_inspect.verify_torchsave,
        torchsave_inspect.FORMAT,
    ),
}


class SavedFilesVerify(FileVerify):
    """DeepSpeed's and verl's `torch.save` files: each file's storages against the zip's CRC-32."""

    def __init__(self, src: str, format_name: str):
        super().__init__(src)
        opener, self.verify_opened, self.one_process, self.format = SAVED_FILES[format_name]
        try:
            self.checkpoint: Any = opener(source_path(self.path))
        except DataCheckError:
            self.checkpoint = None
            return
        opened = self.checkpoint.opened
        self.files = [_unit(f.path.name, f.size, [entry.offset for entry in f.storages.values()]) for f in opened]

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        return self.result(part, self.checkpoint.opened[part.file].crc_checks(part.begin, part.end), progress)

    def report(self, results: list[PartResult]) -> VerifyReport:
        if self.checkpoint is None:
            return self.one_process(self.path)
        checks: list[list] = [[] for _ in self.files]
        for result in results:
            checks[result.file].extend(json.loads(result.problems[0]))
        crcs = [(len(found), [problem for _, problem in sorted(found) if problem is not None]) for found in checks]
        return self.verify_opened(self.checkpoint, VerifyReport(str(self.path), self.format), crcs)

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


def _chunks_json(checkpoint: DcpCheckpoint, file: OutputFile, part: Part) -> dict:
    """The chunks whose records start in `part` of `file` checked (the last part also takes the
    records the metadata places past the file's end: a truncated file's); none when the file does
    not open (the structure check says so)."""
    try:
        checkpoint.file(file.name)
    except DataCheckError:
        return {"checked": 0, "problems": [], "serializations": []}
    end = part.end if part.end < file.nbytes else float("inf")
    found = chunk_checks(checkpoint, lambda name, offset: name == file.name and part.begin <= offset < end)
    return {"checked": found.checked, "problems": found.problems, "serializations": sorted(found.serializations)}


def _chunks_of(found: list[dict]) -> ChunkChecks:
    total = ChunkChecks()
    for one in found:
        total.add(ChunkChecks(one["checked"], [tuple(p) for p in one["problems"]], set(one["serializations"])))
    return total


class DcpVerify(FileVerify):
    """DCP's files: every chunk record in a file located and checked against the metadata."""

    def __init__(self, src: str):
        super().__init__(src)
        try:
            metadata = read_metadata(source_path(self.path), METADATA_GLOBALS)
        except DataCheckError:
            self.checkpoint = None
            return
        self.checkpoint = DcpCheckpoint(metadata, root=source_path(self.path))
        self.files = _sized(self.path, list(metadata.files), _record_starts(self.checkpoint))

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        assert self.checkpoint is not None
        return self.result(part, _chunks_json(self.checkpoint, self.files[part.file], part), progress)

    def report(self, results: list[PartResult]) -> VerifyReport:
        return verify_dcp(self.path, found=_chunks_of(_findings(results)) if self.checkpoint is not None else None)

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


class MegatronVerify(FileVerify):
    """Megatron's files: `torch_dist`'s chunk records (as DCP's), and the SHA-256 of each file
    `integrity.json` lists."""

    def __init__(self, src: str):
        super().__init__(src)
        self.checkpoint: DcpCheckpoint | None = None
        self.opened = False
        try:
            files = find_files(self.path)
            if files is None:
                return
            self.weights, self.hashes = files.weights, integrity_hashes(files.weights)
            if files.backend == TORCH_DIST:
                metadata = read_metadata(files.weights, MEGATRON_METADATA_GLOBALS)
                self.checkpoint = DcpCheckpoint(metadata, root=files.weights)
        except DataCheckError:
            return
        self.opened = True
        names = set(self.checkpoint.metadata.files) if self.checkpoint is not None else set()
        starts = _record_starts(self.checkpoint) if self.checkpoint is not None else {}
        cut = {name: at for name, at in starts.items() if name not in self.hashes}  # a hash is taken front to back
        self.files = _sized(self.weights, sorted(names | set(self.hashes)), cut)

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        name = self.files[part.file].name
        found: dict[str, Any] = {"hashed": {}}
        if self.checkpoint is not None and name in self.checkpoint.metadata.files:
            found.update(_chunks_json(self.checkpoint, self.files[part.file], part))
        if name in self.hashes:
            found["hashed"][name] = hash_problem(self.weights / name, self.hashes[name], memoryview(bytearray(HASH_BLOCK)))
        return self.result(part, found, progress)

    def report(self, results: list[PartResult]) -> VerifyReport:
        if not self.opened:
            return verify_megatron(self.path)
        found = _findings(results)
        chunks = _chunks_of([f for f in found if "checked" in f]) if self.checkpoint is not None else None
        hashed = {name: problem for f in found for name, problem in f["hashed"].items()}
        return verify_megatron(self.path, MegatronChecks(chunks, hashed))

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()


class FullVerify(FileVerify):
    """A full safetensors checkpoint: its headers, sizes and index, read by rank 0 (no data to check)."""

    def run_part(self, part: Part, directory: Path | None, progress: Progress) -> PartResult:
        raise AssertionError(f"{self.path}: a full checkpoint's verify has no parts")

    def report(self, results: list[PartResult]) -> VerifyReport:
        return verify_full(self.path)


VERIFY_JOBS: dict[str, Callable[[str], Any]] = {
    "deepspeed": lambda src: SavedFilesVerify(src, "deepspeed"),
    "torch-save-ranks": lambda src: SavedFilesVerify(src, "torch-save-ranks"),
    "dcp": DcpVerify,
    "megatron": MegatronVerify,
    "full": FullVerify,
}
