"""The staging area of a spread conversion: a hidden sibling of DST whose name does not change
between runs, so that the same command run again after a crash finds it and continues.

    .tmp-DST-resumable/
      model-00001-of-00004.safetensors ...     the output files, as they are written
      .fsdpkit-spread/plan.json                what is being written (its fingerprint)
      .fsdpkit-spread/token                    what every rank must read to know it sees this path
      .fsdpkit-spread/done/00001-00000.json    one record per part written, fsynced and checksummed

A part with a record whose file is there is kept by a later run whose plan has that part (the
same file, the same byte range: `kept_parts`); the rest is redone. A staging area of another
conversion (another source, other options) is refused unless `--restart`, which discards it.
`check_staging` makes every check `prepare` makes before it writes, for `--dry-run`. The commit
removes `.fsdpkit-spread`, syncs the files and renames the area to DST (DST's old contents, with
--overwrite, go aside first and away after); until then DST is untouched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...errors import RunError, UsageError
from ...paths import file_in_the_way, nearest_existing, unwritable_parent
from ..core.names import TMP_PREFIX
from ..core.staging import check_destination, check_destination_name, check_free_space, fsync_dir, os_error_line, read_only_line, sync_files
from ..storage.location import is_url
from .plan import Part, Plan

STATE_DIR = ".fsdpkit-spread"
PLAN_NAME = "plan.json"
TOKEN_NAME = "token"
DONE_DIR = "done"


@dataclass
class PartResult:
    """What one rank did with one part: the checksum of the bytes it wrote (or, verifying, the
    problems it found), the source bytes it read, and the source pieces it read only in part
    (`PartRead`s as lists, for the commit's check of every source checksum)."""

    file: int
    index: int
    name: str
    begin: int
    end: int
    crc32: int = 0
    bytes_read: int = 0
    source_parts: list[list] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    fragments: int = 0
    record_crcs: list[list[int]] = field(default_factory=list)  # a torch zip's: [begin, end, CRC-32] of its storages' bytes written


def staging_path(dst: Path) -> Path:
    check_destination_name(dst)
    return dst.absolute().parent / f"{TMP_PREFIX}{dst.name}-resumable"


def resumable_beside(dst: str) -> Path | None:
    """The staging area an interrupted spread run left beside a local `dst`; None when there is none."""
    if is_url(dst):
        return None
    path = staging_path(Path(dst))
    return path if path.exists() or path.is_symlink() else None


def fingerprint(facts: dict) -> str:
    """A short digest of what a conversion writes from what (same digest: the same output)."""
    return hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Staging:
    path: Path

    @property
    def state(self) -> Path:
        return self.path / STATE_DIR

    @property
    def where(self) -> str:
        return str(self.path)

    def write_state(self, name: str, text: str) -> None:
        (self.state / name).write_text(text)

    def read_state(self, name: str) -> str | None:
        """State file `name`; None when this process does not see it."""
        try:
            return (self.state / name).read_text()
        except OSError:
            return None

    def token(self) -> str | None:
        """The token rank 0 wrote; None when this process does not see it."""
        found = self.read_state(TOKEN_NAME)
        return found.strip() if found is not None else None

    def write_part(self, job: Any, part: Part, progress: Callable[[int], None]) -> PartResult:
        """Part `part` of `job`'s plan written in place in the output's directory."""
        return job.run_part(part, self.path, progress)

    def record(self, result: PartResult) -> None:
        """Make part `result` durable, then record it (a record names only fsynced bytes)."""
        fd = os.open(self.path / result.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        done = self.state / DONE_DIR
        name = f"{result.file:05d}-{result.index:05d}.json"
        tmp = done / f".{name}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(asdict(result)))
        os.replace(tmp, done / name)

    def records(self) -> dict[tuple[int, int], PartResult]:
        """The parts recorded as written, whose file is still there and long enough."""
        found = {}
        done = self.state / DONE_DIR
        for entry in sorted(done.iterdir()) if done.is_dir() else ():
            if entry.name.startswith("."):
                continue
            try:
                result = PartResult(**json.loads(entry.read_text()))
                size = (self.path / result.name).stat().st_size
            except (OSError, ValueError, TypeError):
                continue
            if size >= result.end:
                found[(result.file, result.index)] = result
        return found

    def commit_job(self, job: Any, done: list[PartResult], dst: str, *, overwrite: bool) -> Any:
        """Rank 0: the job's commit files written here, then the staging area becomes DST."""
        report = job.commit(self.path, done, dst)
        self.commit(Path(dst), overwrite=overwrite)
        return report

    def close(self) -> None:
        pass

    def commit(self, dst: Path, *, overwrite: bool) -> None:
        """The staging area becomes DST (see the module docstring)."""
        parent = dst.absolute().parent
        try:
            if (dst.exists() or dst.is_symlink()) and not overwrite:  # the records stay: a rerun with --overwrite continues
                raise UsageError(f"destination {dst} appeared while the conversion ran; pass --overwrite to replace it")
            shutil.rmtree(self.state)
            sync_files(self.path, [entry.name for entry in os.scandir(self.path) if entry.is_file()])
            if dst.exists() or dst.is_symlink():
                old = parent / f"{TMP_PREFIX}old-{dst.name}-{uuid.uuid4().hex[:8]}"
                os.rename(dst, old)
                os.rename(self.path, dst)
                fsync_dir(parent)
                shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
            else:
                os.rename(self.path, dst)
            fsync_dir(parent)
        except OSError as error:
            raise RunError(f"committing {dst} failed: {os_error_line(error, self.path)}") from None


class PartRecorder:
    """The parts a rank wrote, recorded (`record`: a local file fsynced, then its record written)
    in order by a thread of their own while the rank writes its next part, so that the disk
    writes one part out while the next is read, cast and checksummed. A part whose record was
    not yet written when its process died is written again by the next run."""

    def __init__(self, record: Callable[[PartResult], None]):
        self._record = record
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fsdpkit-record")
        self._pending: list[tuple[Part, Future]] = []

    def add(self, part: Part, result: PartResult) -> None:
        self._pending.append((part, self._pool.submit(self._record, result)))

    def failure(self, *, wait: bool) -> tuple[Part, BaseException] | None:
        """The first part whose record failed, and why: of those recorded so far, or (`wait`)
        once every part added is recorded."""
        for part, future in self._pending:
            if not wait and not future.done():
                return None
            error = future.exception()
            if error is not None:
                return part, error
        return None

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def kept_parts(plan: Plan, records: dict[tuple[int, int], PartResult]) -> dict[tuple[int, int], PartResult]:
    """The recorded parts that `plan` keeps: those of its parts recorded with the same file and
    byte range (a file cut otherwise, for another number of ranks, is written again)."""
    kept = {}
    for part in plan.parts:
        found = records.get((part.file, part.index))
        if found is not None and (found.name, found.begin, found.end) == (plan.files[part.file].name, part.begin, part.end):
            kept[(part.file, part.index)] = found
    return kept


def check_staging(dst: Path, *, src: Path, digest: str, overwrite: bool, restart: bool, needed_bytes: int) -> Staging:
    """Every check `prepare` makes before it writes (DST, its parent, a staging area of another
    conversion, free space), writing nothing: the staging area of DST (there or not)."""
    check_destination(dst, src=src, overwrite=overwrite)
    staging = Staging(staging_path(dst))
    parent = staging.path.parent
    if (blocker := file_in_the_way(parent)) is not None:
        raise UsageError(f"destination {dst} cannot be created: {blocker} is a file, not a directory; nothing written")
    if (unwritable := unwritable_parent(parent)) is not None:
        raise UsageError(read_only_line(Path(unwritable)))
    if staging.path.exists():
        with held_by_this_process(staging.path, dst):
            pass
    if staging.path.exists() and not restart:
        try:
            found = json.loads((staging.state / PLAN_NAME).read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            found = None
        if found != digest:
            raise UsageError(
                f"{staging.path} holds the partial output of another conversion (other source or options): "
                "pass --restart to discard it, or remove it"
            )
    try:  # the output files are written in place: what the staging area holds already counts
        check_free_space(Path(nearest_existing(parent)), max(0, needed_bytes - staged_bytes(staging.path)))
    except OSError as error:
        raise RunError(f"cannot write to {parent}: {os_error_line(error, parent)}") from None
    return staging


def staged_bytes(directory: Path) -> int:
    """The bytes the files directly in `directory` take on its disk (0 when it is not there)."""
    try:
        return sum(entry.stat().st_blocks * 512 for entry in os.scandir(directory) if entry.is_file(follow_symlinks=False))
    except OSError:
        return 0


@contextlib.contextmanager
def held_by_this_process(path: Path, dst: Path) -> Iterator[None]:
    """The staging area `path` of `dst` locked by this process while the block runs (a
    UsageError when another process holds it); where the filesystem has no locks, unlocked."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"destination {dst} is being written by another fsdpkit command (it holds {path}): wait for it to finish; nothing written"
            ) from None
        except OSError as error:
            if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)


def prepare(
    dst: Path, *, src: Path, digest: str, overwrite: bool, restart: bool, needed_bytes: int, held: contextlib.ExitStack
) -> tuple[Staging, int]:
    """Rank 0: the staging area of DST for the conversion `digest`, made or found again
    (`restart`: emptied), with a new token, locked by this process until `held` closes; and how
    many parts it already holds."""
    staging = check_staging(dst, src=src, digest=digest, overwrite=overwrite, restart=restart, needed_bytes=needed_bytes)
    parent = staging.path.parent
    try:
        staging.path.mkdir(parents=True, exist_ok=True)
        held.enter_context(held_by_this_process(staging.path, dst))
        if restart:
            for entry in os.scandir(staging.path):
                shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
        (staging.state / DONE_DIR).mkdir(parents=True, exist_ok=True)
        kept = len(staging.records())
        (staging.state / PLAN_NAME).write_text(json.dumps({"fingerprint": digest}) + "\n")
        (staging.state / TOKEN_NAME).write_text(uuid.uuid4().hex + "\n")
    except OSError as error:
        if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UsageError(read_only_line(Path(error.filename or parent), error.errno)) from None
        raise RunError(f"cannot write to {parent}: {os_error_line(error, parent)}") from None
    return staging, kept
