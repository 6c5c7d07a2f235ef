"""fsdpkit's sharded checkpoints read through the storage face (an object store, or any
storage): the step a location denotes, `verify` with every fragment's crc32 computed as the
bytes stream in (FILES_IN_FLIGHT rank files at once, each read in one stream from its first
byte, header then data, each byte fetched once), and `inspect`'s summary from the manifest and the rank files' headers.
Version 2 checkpoints only: a version 1 manifest lists what version 2 derives, and is read from
local directories."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from ...errors import DataCheckError, UsageError
from ..core.crc import crc32
from ..core.names import is_safe_file_name, parse_json
from ..core.report import VerifyReport
from ..core.request import Progress, progress_callback
from ..core.summary import FileEntry, ShardedSummary
from ..storage.face import Storage
from .manifest import Manifest
from .names import LATEST_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, parse_step_dir_name, rank_file_name
from .placement import FileLayout
from .reader import v2_crcs
from .verify import sharded_summary

FILES_IN_FLIGHT = 4  # rank files read at once, each a bounded stream (storage/objects.py)
BLOCK_BYTES = 8 << 20


def is_stored_sharded(listed: dict[str, int]) -> bool:
    """The objects `listed` (name -> size) hold an fsdpkit step or run."""
    return MANIFEST_NAME in listed or LATEST_NAME in listed or any(_step_of(name) is not None for name in listed)


def _step_of(name: str) -> str | None:
    first, _, rest = name.partition("/")
    return first if rest == MANIFEST_NAME and parse_step_dir_name(first) is not None else None


def resolve_stored(storage: Storage, listed: dict[str, int]) -> tuple[str, Manifest]:
    """(the step's prefix inside `storage`, "" for its root; its manifest) of the step directory
    or run that `storage` holds: `latest`, else the newest step with a manifest."""
    if MANIFEST_NAME in listed:
        step = ""
    elif LATEST_NAME in listed:
        step = storage.read(LATEST_NAME, 0, min(listed[LATEST_NAME], 256)).decode("ascii", "replace").strip()
        if parse_step_dir_name(step) is None or not is_safe_file_name(step):
            raise DataCheckError(f"{storage.where(LATEST_NAME)}: holds {step[:40]!r}, expected a step directory name such as step-00000100")
        if f"{step}/{MANIFEST_NAME}" not in listed:
            raise DataCheckError(f"{storage.where(LATEST_NAME)}: names {step}, which is missing or has no {MANIFEST_NAME}")
    else:
        steps = sorted((parse_step_dir_name(s), s) for s in {_step_of(name) for name in listed} if s is not None)
        if not steps:
            raise UsageError(f"{storage.root}: not an fsdpkit checkpoint (no {MANIFEST_NAME}, no {LATEST_NAME}, no step-*/{MANIFEST_NAME})")
        step = steps[-1][1]
    name = _in(step, MANIFEST_NAME)
    if listed[name] > MAX_MANIFEST_BYTES:
        raise DataCheckError(f"{storage.where(name)}: over the {MAX_MANIFEST_BYTES}-byte manifest limit")
    where = storage.where(name)
    manifest = Manifest.from_json(parse_json(storage.read(name), where=where, what="manifest"), where=where)
    if manifest.listing is not None:
        raise UsageError(f"{where}: a version 1 checkpoint is read from a local directory only; download it, or convert it locally")
    return step, manifest


def _in(step: str, name: str) -> str:
    return f"{step}/{name}" if step else name


def verify_stored(storage: Storage, listed: dict[str, int], progress: Progress | None = None) -> VerifyReport:
    report = VerifyReport(storage.root, "sharded")
    try:
        step, manifest = resolve_stored(storage, listed)
    except DataCheckError as error:
        return report.failed(str(error))
    report.path = storage.where(step) if step else storage.root
    layout = manifest.layout()
    files = [(_in(step, rank_file_name(rank, manifest.shard_factor)), layout.file_layout(rank)) for rank in range(manifest.shard_factor)]
    count = progress_callback(progress, sum(listed.get(name, 0) for name, _ in files))
    with ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="fsdpkit-verify") as pool:
        results = list(pool.map(lambda file: _check_file(storage, listed, manifest, file[0], file[1], count), files))
    problems = [problem for found, _ in results for problem in found]
    expected = {name for name, _ in files} | {_in(step, MANIFEST_NAME)}
    extra = sorted(
        name for name in listed if name.startswith(_in(step, "")) and name not in expected and "/" not in name[len(_in(step, "")) :]
    )
    if extra:
        problems.append(f"{report.path}: holds files the manifest does not account for: {extra[:3]}")
    report.ok, report.problems, report.tensors, report.bytes = not problems, problems, len(manifest.tensors), sum(n for _, n in results)
    report.counts = {"fragment": sum(len(expected.tensors) for _, expected in files)}
    report.checked = [f"the crc32 of all {report.counts['fragment']} fragments", "file sizes", "headers", "fragment coverage", "file names"]
    return report


def _check_file(
    storage: Storage, listed: dict[str, int], manifest: Manifest, name: str, expected: FileLayout, progress: Callable[[int], None] | None
) -> tuple[list[str], int]:
    """(one line per problem, data bytes checked) of one rank file, read in one stream front to
    back: its header first, then the data, each fragment's crc32 computed block by block."""
    where = storage.where(name)
    try:
        _check_size(listed, where, name, expected)
        with contextlib.closing(storage.read_blocks(name, [(0, expected.size)], block_bytes=BLOCK_BYTES)) as blocks:
            header, data = _split(_counted(blocks, progress), expected.data_start)
            stored = v2_crcs(where, header, expected)
            return _check_data(where, manifest, data, expected, stored), expected.size - expected.data_start
    except DataCheckError as error:
        return [str(error)], 0


def _counted(blocks: Iterator[tuple[int, memoryview]], progress: Callable[[int], None] | None) -> Iterator[tuple[int, memoryview]]:
    for offset, block in blocks:
        yield offset, block
        if progress is not None:
            progress(len(block))


def _split(blocks: Iterator[tuple[int, memoryview]], data_start: int) -> tuple[bytes, Iterator[tuple[int, memoryview]]]:
    """(the first `data_start` bytes of `blocks`, the blocks after them)."""
    header, rest = bytearray(), list[tuple[int, memoryview]]()
    while len(header) < data_start:
        offset, block = next(blocks)
        take = data_start - len(header)
        header += block[:take]
        if take < len(block):
            rest.append((offset + take, block[take:]))
    return bytes(header), itertools.chain(rest, blocks)


def _check_data(
    where: str, manifest: Manifest, blocks: Iterator[tuple[int, memoryview]], expected: FileLayout, stored: tuple[int, ...]
) -> list[str]:
    """One line per fragment whose crc32 differs from `stored`, the data read front to back."""
    problems: list[str] = []
    spans, index, crc = expected.spans, 0, 0
    for offset, block in blocks:
        position = offset - expected.data_start
        base = position
        while base < position + len(block) and index < len(spans):
            stop = min(spans[index][1], position + len(block))
            crc = crc32(block[base - position : stop - position], crc)
            base = stop
            if stop == spans[index][1]:
                if crc != stored[index]:
                    tensor = manifest.tensors[expected.tensors[index]].name
                    problems.append(
                        f"{where}: checksum mismatch in tensor {tensor!r}: stored crc32 {stored[index]:08x}, data gives {crc:08x}"
                    )
                index, crc = index + 1, 0
    return problems


def _check_size(listed: dict[str, int], where: str, name: str, expected: FileLayout) -> None:
    size = listed.get(name)
    if size is None:
        raise DataCheckError(f"{where}: file is missing")
    if size != expected.size:
        raise DataCheckError(
            f"{where}: file is {size} bytes, the layout the manifest gives has {expected.size} "
            "(truncated, extended or from another checkpoint)"
        )


def _stored_crcs(storage: Storage, listed: dict[str, int], name: str, expected: FileLayout) -> tuple[int, ...]:
    where = storage.where(name)
    _check_size(listed, where, name, expected)
    return v2_crcs(where, storage.read(name, 0, expected.data_start), expected)


def summarize_stored(storage: Storage, listed: dict[str, int]) -> ShardedSummary:
    step, manifest = resolve_stored(storage, listed)
    layout = manifest.layout()
    names = [_in(step, rank_file_name(rank, manifest.shard_factor)) for rank in range(manifest.shard_factor)]
    for rank, name in enumerate(names):  # each header checked, as the local reader does
        _stored_crcs(storage, listed, name, layout.file_layout(rank))
    files = [FileEntry(name.rpartition("/")[2], listed[name]) for name in names]
    fragments = sum(len(layout.file_layout(rank).tensors) for rank in range(manifest.shard_factor))
    return sharded_summary(storage.where(step) if step else storage.root, manifest, files, fragments)
