"""`fsdpkit verify`: every check a checkpoint can be put through, as a list of problems.

Sharded checkpoints: the manifest (schema, version, safe file names, fragment coverage
exactly once, plan and aliases consistent), every file (present, size as recorded,
safetensors header valid and agreeing with the manifest, no unreferenced keys), and the
crc32 of every fragment, recomputed by streaming the bytes through one reused buffer (no
torch). Full checkpoints (model.safetensors / index): headers, sizes and the index; they
carry no checksums. `verify_checkpoint` returns a JSON-able report; `ok` is true when
`problems` is empty.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable

from ...errors import DataCheckError
from ..bytecopy import DEFAULT_CHUNK_SIZE
from ..format import MANIFEST_NAME, dtype_info
from ..manifest import load_manifest
from ..reader import check_files, is_full_checkpoint, open_full
from ..storage import resolve_checkpoint


def verify_checkpoint(path: str | Path, *, chunk_size: int = DEFAULT_CHUNK_SIZE, progress: Callable[[int, int], None] | None = None) -> dict:
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
    headers, problems = check_files(step_dir, manifest)
    report["problems"].extend(problems)
    work = []
    for tensor in manifest.tensors:
        itemsize = dtype_info(tensor.dtype).itemsize
        for frag in tensor.fragments:
            header = headers.get(frag.file)
            info = header.tensors.get(frag.key) if header else None
            if info is not None and info.dtype == tensor.dtype and info.nbytes == (frag.end - frag.start) * itemsize:
                work.append((header.path, header.data_start + info.begin, info.nbytes, frag))
    total = sum(nbytes for _, _, nbytes, _ in work)
    if progress:
        progress(0, total)
    buffer = bytearray(chunk_size)
    fds: dict[Path, int] = {}
    try:
        for file_path, offset, nbytes, frag in sorted(work, key=lambda w: (str(w[0]), w[1])):
            fd = fds.get(file_path)
            if fd is None:
                for old in fds.values():
                    os.close(old)
                fds = {file_path: os.open(file_path, os.O_RDONLY)}
                fd = fds[file_path]
            crc = _crc_of(fd, offset, nbytes, buffer, progress, total)
            if crc != frag.crc32:
                report["problems"].append(f"{file_path}: checksum mismatch in key {frag.key!r} [{frag.start}, {frag.end}): "
                                          f"stored crc32 {frag.crc32:08x}, data gives {crc:08x}")
    finally:
        for fd in fds.values():
            os.close(fd)
    report.update(ok=not report["problems"], tensors=len(manifest.tensors), fragments=len(work), bytes=total)
    return report


def _crc_of(fd: int, offset: int, nbytes: int, buffer: bytearray, progress, total: int) -> int:
    crc, done = 0, 0
    view = memoryview(buffer)
    while done < nbytes:
        want = min(len(buffer), nbytes - done)
        count = os.preadv(fd, [view[:want]], offset + done)
        if count == 0:
            break
        crc = zlib.crc32(view[:count], crc)
        done += count
        if progress:
            progress(count, total)
    return crc


def _verify_full(path: Path) -> dict:
    report = {"path": str(path), "kind": "full", "ok": False, "problems": [], "tensors": 0, "fragments": 0, "bytes": 0}
    try:
        full = open_full(path)
    except DataCheckError as error:
        report["problems"].append(str(error))
        return report
    report.update(ok=True, tensors=len(full.tensors), bytes=sum(t.nbytes for t in full.tensors))
    return report
