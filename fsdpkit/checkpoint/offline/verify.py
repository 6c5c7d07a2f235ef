"""`fsdpkit verify`: every check a checkpoint can be put through, as a list of problems.

Sharded checkpoints: the manifest (schema, version, tensor table, placement, aliases), every
rank file (a regular file, present, of the size and with the header the manifest derives;
v1: as listed, keys and dtypes agreeing), nothing else in the directory, and the crc32 of
every fragment, recomputed file by file, front to back, through one reused buffer (no torch;
memory does not grow with the world size; from 256 files on, several processes share the
files). Full checkpoints (model.safetensors / index):
headers, sizes and the index; they carry no checksums. `verify_checkpoint` returns a JSON-able
report; `ok` is true when `problems` is empty.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable

from ...errors import DataCheckError
from ..bytecopy import DEFAULT_CHUNK_SIZE
from ..format import MANIFEST_NAME
from ..manifest import load_manifest
from ..reader import RankFile, ShardedCheckpoint, is_full_checkpoint, open_full, open_regular
from ..storage import resolve_checkpoint
from ..writer import in_processes, worker_count


def verify_checkpoint(path: str | Path, *, chunk_size: int = DEFAULT_CHUNK_SIZE, progress: Callable[[int, int], None] | None = None,
                      workers: int | None = None) -> dict:
    path = Path(path)
    if path.exists() and is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists()):
        return _verify_full(path)
    report = {"path": str(path), "kind": "sharded", "ok": False, "problems": [], "tensors": 0, "fragments": 0, "bytes": 0}
    try:
        step_dir = resolve_checkpoint(path)
        report["path"] = str(step_dir)
        manifest = load_manifest(step_dir)
    except DataCheckError as error:
        report["problems"].append(str(error))
        return report
    checkpoint = ShardedCheckpoint(step_dir, manifest)
    total = sum(t.nbytes for t in manifest.tensors)
    if progress:
        progress(0, total)
    advance = (lambda count: progress(count, total)) if progress else None
    files = len(checkpoint.file_names())
    workers = worker_count(files, workers)
    jobs = [(checkpoint, files * i // workers, files * (i + 1) // workers, chunk_size) for i in range(workers)]
    outcomes = [check_files(*jobs[0], progress=advance)] if workers == 1 else in_processes(check_files, jobs, advance)
    problems = report["problems"]
    for found, _, _ in outcomes:
        problems.extend(found)
    problems.extend(checkpoint.unexpected_files())
    report.update(ok=not problems, tensors=len(manifest.tensors), fragments=sum(n for _, n, _ in outcomes),
                  bytes=sum(b for _, _, b in outcomes))
    return report


def check_files(checkpoint: ShardedCheckpoint, first: int, last: int, chunk_size: int, *,
                progress: Callable[[int], None] | None = None) -> tuple[list[str], int, int]:
    """Files `first` to `last - 1`: (one line per problem, fragments checked, bytes checked)."""
    problems, fragments, checked = [], 0, 0
    buffer = bytearray(chunk_size)
    for index in range(first, last):
        try:
            rank_file = checkpoint.rank_file(index, cache=False)
            problems.extend(_check_crcs(rank_file, checkpoint.manifest, buffer, progress or (lambda count: None)))
        except DataCheckError as error:
            problems.append(str(error))
            continue
        fragments += len(rank_file)
        checked += int(sum(rank_file.ends) - sum(rank_file.begins))
    return problems, fragments, checked


def _check_crcs(rank_file: RankFile, manifest, buffer: bytearray, advance: Callable[[int], None]) -> list[str]:
    """Read the file's data front to back, one buffer at a time; one line per fragment whose
    crc32 differs."""
    problems = []
    if not len(rank_file):
        return problems
    fd, _ = open_regular(rank_file.path)
    try:
        view = memoryview(buffer)
        position, end = rank_file.begins[0], rank_file.ends[-1]  # relative to the data buffer
        index, crc = 0, 0
        while position < end:
            count = os.preadv(fd, [view[:min(len(buffer), end - position)]], rank_file.data_start + position)
            if count == 0:
                raise DataCheckError(f"{rank_file.path}: file ends before its data does (truncated)")
            block, base = view[:count], position
            while base < position + count:
                stop = min(rank_file.ends[index], position + count)
                crc = zlib.crc32(block[base - position: stop - position], crc)
                base = stop
                if stop == rank_file.ends[index]:
                    if crc != rank_file.crcs[index]:
                        name = manifest.tensors[rank_file.tensors[index]].name
                        problems.append(f"{rank_file.path}: checksum mismatch in tensor {name!r}: stored crc32 "
                                        f"{rank_file.crcs[index]:08x}, data gives {crc:08x}")
                    index, crc = index + 1, 0
            position += count
            advance(count)
    finally:
        os.close(fd)
    return problems


def _verify_full(path: Path) -> dict:
    report = {"path": str(path), "kind": "full", "ok": False, "problems": [], "tensors": 0, "fragments": 0, "bytes": 0}
    try:
        full = open_full(path)
    except DataCheckError as error:
        report["problems"].append(str(error))
        return report
    report.update(ok=True, tensors=len(full.tensors), bytes=sum(t.nbytes for t in full.tensors))
    return report
