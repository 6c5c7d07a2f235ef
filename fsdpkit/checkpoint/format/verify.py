"""`fsdpkit verify` and `fsdpkit inspect` of fsdpkit's sharded checkpoints and full ones. A sharded
checkpoint's rank files are checked one by one through one reused buffer (memory does not grow with
the world size; what is checked: `VerifyReport.checked`); full checkpoints carry no checksums.
`summarize` reads headers only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ...errors import DataCheckError
from ..core.bytecopy import DEFAULT_CHUNK_SIZE, PROGRESS_BYTES
from ..core.crc import crc32
from ..core.report import VerifyReport
from ..core.request import progress_callback
from ..core.summary import FileEntry, FullSummary, ShardedSummary, tensor_stats
from .manifest import Manifest, load_manifest
from .names import FORMAT_NAME
from .placement import FileLayout
from .reader import RankFile, ShardedCheckpoint, has_optimizer_files, open_full, open_sharded, v2_crcs
from .storage import resolve_checkpoint

WHOLE_FILE_BYTES = 8 * 1024 * 1024  # rank files up to this size are read whole


def verify_checkpoint(
    path: str | Path, progress: Callable[[int, int], None] | None = None, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> VerifyReport:
    report = VerifyReport(str(path), "sharded")
    try:
        step_dir = resolve_checkpoint(path)
        report.path = str(step_dir)
        manifest = load_manifest(step_dir)
    except DataCheckError as error:
        return report.failed(str(error))
    checkpoint = ShardedCheckpoint(step_dir, manifest)
    advance = progress_callback(progress, sum(t.nbytes for t in manifest.tensors))
    problems, fragments, checked = check_files(checkpoint, chunk_size, progress=advance)
    problems.extend(checkpoint.unexpected_files())
    report.ok, report.problems, report.tensors, report.bytes = not problems, problems, len(manifest.tensors), checked
    report.counts = {"fragment": fragments}
    report.checked = [f"the crc32 of all {fragments} fragments", "file sizes", "headers", "fragment coverage", "file names"]
    return report


def check_files(
    checkpoint: ShardedCheckpoint,
    chunk_size: int,
    *,
    progress: Callable[[int], None] | None = None,
    indices: Sequence[int] | None = None,
) -> tuple[list[str], int, int]:
    """Every rank file (or those of `indices`): (one line per problem, fragments checked, bytes checked). A v2 file of
    at most WHOLE_FILE_BYTES is read with one system call into a reused buffer, its header
    compared with the derived one, and each fragment's crc32 computed on a slice of it."""
    problems, fragments, checked, unreported = [], 0, 0, 0
    buffer = bytearray(max(chunk_size, WHOLE_FILE_BYTES if checkpoint.layout is not None else 0))
    for index in range(len(checkpoint.file_names())) if indices is None else indices:
        try:
            expected = checkpoint.layout.file_layout(index) if checkpoint.layout is not None else None
            if expected is not None and expected.size <= WHOLE_FILE_BYTES:
                found, count, nbytes = _check_whole_v2(checkpoint, index, expected, memoryview(buffer))
                unreported += nbytes
            else:
                rank_file = checkpoint.rank_file(index, cache=False)
                found = _check_crcs(rank_file, checkpoint.manifest, buffer, progress or (lambda count: None))
                count, nbytes = len(rank_file), int(sum(rank_file.ends) - sum(rank_file.begins))
        except DataCheckError as error:
            problems.append(str(error))
            continue
        problems.extend(found)
        fragments += count
        checked += nbytes
        if progress is not None and unreported >= PROGRESS_BYTES:
            progress(unreported)
            unreported = 0
    if progress is not None and unreported:
        progress(unreported)
    return problems, fragments, checked


def _check_whole_v2(checkpoint: ShardedCheckpoint, rank: int, expected: FileLayout, buffer: memoryview) -> tuple[list[str], int, int]:
    path, view = checkpoint.read_whole_v2(rank, expected, buffer)
    size, start = len(view), expected.data_start
    stored = v2_crcs(path, bytes(view[:start]), expected)
    found = [crc32(view[start + begin : start + end]) for begin, end in expected.spans]
    names = [checkpoint.manifest.tensors[tensor].name for tensor in expected.tensors]
    problems = [_mismatch(path, name, crc, got) for name, crc, got in zip(names, stored, found, strict=True) if got != crc]
    return problems, len(expected.tensors), size - start


def _mismatch(path: Path, name: str, stored: int, found: int) -> str:
    return f"{path}: checksum mismatch in tensor {name!r}: stored crc32 {stored:08x}, data gives {found:08x}"


def _check_crcs(rank_file: RankFile, manifest, buffer: bytearray, advance: Callable[[int], None]) -> list[str]:
    """Read the file's data front to back, one buffer at a time; one line per fragment whose
    crc32 differs."""
    problems: list[str] = []
    index, crc = 0, 0
    for position, block in rank_file.data_blocks(memoryview(buffer)):
        base = position
        while base < position + len(block):
            stop = min(rank_file.ends[index], position + len(block))
            crc = crc32(block[base - position : stop - position], crc)
            base = stop
            if stop == rank_file.ends[index]:
                if crc != rank_file.crcs[index]:
                    problems.append(_mismatch(rank_file.path, manifest.tensors[rank_file.tensors[index]].name, rank_file.crcs[index], crc))
                index, crc = index + 1, 0
        advance(len(block))
    return problems


def verify_full(path: Path) -> VerifyReport:
    report = VerifyReport(str(path), "full", not_checked=["the data (this format has no checksums)"])
    try:
        full = open_full(path, with_optimizer=has_optimizer_files(path))
    except DataCheckError as error:
        return report.failed(str(error))
    report.ok, report.tensors, report.bytes = True, len(full.tensors), sum(t.nbytes for t in full.tensors)
    report.counts = {"file": len(full.files)}
    report.checked = ["headers", "file sizes", "the index"]
    return report


def summarize_full(path: Path) -> FullSummary:
    full = open_full(path, with_optimizer=has_optimizer_files(path))
    files = [FileEntry(f.name, f.stat().st_size) for f in full.files]
    return FullSummary(str(path), "full", *tensor_stats([(t.name, t.dtype, t.shape) for t in full.tensors]), files, full.aliases)


def summarize(path: str | Path) -> ShardedSummary:
    checkpoint = open_sharded(path)
    manifest = checkpoint.manifest
    files = [checkpoint.rank_file(index) for index in range(len(checkpoint.file_names()))]
    return sharded_summary(str(checkpoint.step_dir), manifest, [FileEntry(f.path.name, f.size) for f in files], sum(len(f) for f in files))


def sharded_summary(where: str, manifest: Manifest, files: list[FileEntry], fragments: int) -> ShardedSummary:
    """What `inspect` says of an fsdpkit checkpoint, wherever its files are read from."""
    state = manifest.training_state
    return ShardedSummary(
        where,
        FORMAT_NAME,
        *tensor_stats([(t.name, t.dtype, t.shape) for t in manifest.tensors]),
        files=files,
        aliases=manifest.aliases,
        version=manifest.version,
        world_size=manifest.shard_factor,
        strategy=manifest.strategy,
        placement=manifest.placement.kind,
        units=len(manifest.placement.units),
        step=state.get("step"),
        samples=state.get("samples"),
        data_position=state.get("data_position"),
        config=state.get("config"),
        fragments=fragments,
    )
