"""`convert` and `reshard` output written file by file into a storage through the face, from the
plan of a spread job (every file's size and offsets known before any byte is read), in one
process: to an object-store URL, with bounded local disk and memory.

`write_planned_file` writes one planned output file whole into a storage, local directory or
bucket. A file whose bytes the job produces in offset order (full safetensors, DCP, DeepSpeed,
Megatron's DCP file: the job's `write_part`) is one write stream (a multipart upload, parts
uploaded while the next bytes are read), with no local copy, except for a full output read from
a bucket whose objects hold its tensors in another order: that is filled from one pass over each
object into a local spool of the file, sent as its bytes arrive (`scattered`). fsdpkit's rank files carry their
fragments' crc32s in the header, written after the data, so each is written into a local spool
file first, uploaded, and removed at once: local disk holds one rank file, never the checkpoint.

`convert_to` and `reshard_to` write a URL destination so: the planned files one after another,
then the commit-time files the job writes (manifest, DCP's `.metadata`, DeepSpeed's `latest`,
indexes, Megatron's common files; a few small files in a temporary directory), the commit object
last and alone, in `storage.upload.publishing`'s frame (the writer's lease, the old commit object
deleted first, what was written removed on a failure). Where the commit object is a planned file
(a full checkpoint's one `model.safetensors`), its upload is held open until the job's checks
have passed and every other object is up. What the jobs leave to one process (a full export in
its own layout back to dcp or sharded) is written into a local temporary directory and
uploaded."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..core.report import WriteReport
from ..core.request import ConvertRequest, Progress, ReshardRequest, progress_callback
from ..offline.formats import detect_format
from ..offline.locations import convert_at, reshard_at, source_at
from ..storage.face import Storage
from ..storage.lease import WriterLease
from ..storage.local import LocalStorage
from ..storage.location import is_url, open_storage
from ..storage.upload import claim_destination, commit_object, copy_into, publishing, upload_file
from .plan import Part
from .staging import PartResult
from .writes import StreamSink

SPOOL_PREFIX = "fsdpkit-spool-"  # the local directory of a file written before its upload


def write_planned_file(job: Any, index: int, storage: Storage, progress: Callable[[int], None] | None = None) -> PartResult:
    """Output file `index` of `job`'s plan written whole into `storage` (local or a URL); what
    the job's commit checks. The object appears only when it is whole."""
    with planned_file(job, index, storage, progress) as result:
        return result


@contextlib.contextmanager
def planned_file(job: Any, index: int, storage: Storage, progress: Any = None) -> Iterator[PartResult]:
    """Output file `index` of `job`'s plan written into `storage`, the object still unfinished
    while the block runs: it appears when the block ends without an error (a multipart upload
    completed), and never when it fails (the upload aborted)."""
    file = job.files[index]
    part = Part(index, 0, 0, file.nbytes)
    if hasattr(job, "write_part"):
        with storage.write(file.name) as stream:
            with StreamSink(stream, storage.where(file.name), 0, file.nbytes) as sink:
                result = job.write_part(part, sink, progress)
            yield result
        return
    with tempfile.TemporaryDirectory(prefix=SPOOL_PREFIX) as spool:
        result = job.run_part(part, Path(spool), progress)  # the header (its crc32s) goes in last
        with storage.write(file.name) as stream:
            copy_into(LocalStorage(spool), file.name, stream)
            yield result


def convert_to(src: str, dst: str, request: ConvertRequest, progress: Progress | None = None) -> WriteReport:
    """`convert` from a local directory or a URL (read in place) to either; to a URL streamed."""
    if not is_url(dst):
        return convert_at(src, dst, request, progress)
    from .dispatch import open_job  # the spread jobs only for a URL: a local convert starts without them
    from .jobs import OneProcessOnly

    try:
        job = open_job("convert", src, request=request, chunk_size=request.chunk_size)
    except OneProcessOnly:
        return convert_at(src, dst, request, progress)
    return _streamed(job, dst, overwrite=request.overwrite, progress=progress)


def reshard_to(src: str, dst: str, request: ReshardRequest) -> WriteReport:
    """`reshard` from a local directory or a URL (read in place) to either; to a URL streamed."""
    if not is_url(dst):
        return reshard_at(src, dst, request)
    from .dispatch import RESHARD_JOBS, open_job

    if detect_format(source_at(src)).name not in RESHARD_JOBS:
        return reshard_at(src, dst, request)  # says in one line that it has no ranks to lay out
    job = open_job("reshard", src, world_size=request.world_size, chunk_size=request.chunk_size)
    report = _streamed(job, dst, overwrite=request.overwrite, progress=request.progress)
    for line in report.warnings if request.warn is not None else ():
        request.warn(line)  # type: ignore[misc]
    return report


def _streamed(job: Any, url: str, *, overwrite: bool, progress: Progress | None) -> WriteReport:
    """`job`'s output written at `url` file by file, the commit object last (module docstring)."""
    try:
        storage = open_storage(url)
        count = progress_callback(progress, job.source_bytes)
        names = [file.name for file in job.files]
        planned_commit = commit_object(names)
        lease, existing = claim_destination(storage, overwrite=overwrite)
        with publishing(storage, existing, lease) as written:
            results = []
            for index, name in enumerate(names):
                if name != planned_commit:
                    written.append(name)  # before its upload: one completed as the write is cut short goes too
                    results.append(write_planned_file(job, index, storage, count))
            if planned_commit is None:
                return _committed(job, storage, lease, results, url, written)
            written.append(planned_commit)
            with planned_file(job, names.index(planned_commit), storage, count) as result:
                return _committed(job, storage, lease, [*results, result], url, written)
    finally:
        job.close()


def _committed(job: Any, storage: Storage, lease: WriterLease, results: list[PartResult], url: str, written: list[str]) -> WriteReport:
    """The job's checks and commit-time files (into a small local directory), uploaded, the
    commit object among them last, once `lease` is found still this write's; the job's report."""
    with tempfile.TemporaryDirectory(prefix="fsdpkit-commit-") as directory:
        for name in {file.name.rpartition("/")[0] for file in job.files} - {""}:
            (Path(directory) / name).mkdir(parents=True, exist_ok=True)  # a DeepSpeed tag's directory
        report = job.commit(Path(directory), results, url)
        small = LocalStorage(directory)
        names = sorted(small.list())
        commit = commit_object(names)
        for name in [*(name for name in names if name != commit), *([commit] if commit else [])]:
            if name == commit:
                lease.check()
            written.append(name)
            upload_file(small, storage, name)
    if commit is None:  # the commit object is the planned file the caller completes next
        lease.check()
    return report
