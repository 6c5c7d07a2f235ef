"""One writer per run directory: a lock file naming the run that holds it (no torch).

`run/.lock` holds JSON `{"host", "pid", "started", "run"}`: the holder's host name, process id
and start time, and the run id that the checkpoints it writes carry (`--keep-last` prunes only
checkpoints with this id): made from the holder's identity, or given (a run that goes on from
its own newest checkpoint keeps that checkpoint's id). A second `acquire` while the holder lives
is a `UsageError` naming the holder. A stale lock (its pid is not running on this host, or is
another process than the one that took it) is taken over, with a message through `warn`; one
held from another host never is (only that host can tell whether its holder is alive).
Creating the lock file is atomic (O_EXCL); taking over renames the stale file first, so of two
processes racing for it one wins.

A run directory in an object store (a URL) holds `.lock` the same way, made with the storage's
conditional create (`If-None-Match: *`): of two runs starting at once, one gets it. Taking over
a stale lock there deletes it and creates it again (a check, then a delete: two runs taking over
the same stale lock in the same instant may both proceed; docs/object-storage.md).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from ...errors import DataCheckError, UsageError
from ...holder import holder_alive, process_identity, run_id_of, seen_from_here
from ..core.files import read_regular
from ..storage.face import Storage
from ..storage.location import is_url, open_storage

LOCK_NAME = ".lock"


def _describe(holder: dict | None) -> str:
    if holder is None:
        return "a holder whose lock file cannot be read"
    return f"pid {holder.get('pid')} on {holder.get('host')} (run {holder.get('run')})"


class RunLock:
    def __init__(self, path: Path | None, holder: dict, storage: Storage | None = None):
        self.path, self.storage = path, storage  # a local file, or `.lock` of an object store
        self.run_id: str = holder["run"]

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, *, warn: Callable[[str], None] | None = None, run_id: str | None = None) -> RunLock:
        if is_url(run_dir):
            return _acquire_stored(open_storage(str(run_dir)), warn=warn, run_id=run_id)
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"cannot create the run directory {run_dir}: {error.strerror}") from None
        path = run_dir / LOCK_NAME
        identity = process_identity()
        holder = {**identity, "run": run_id or run_id_of(identity)}
        for _ in range(3):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                current = _read(path)
                if current is None or not seen_from_here(current) or holder_alive(current):
                    raise UsageError(
                        f"{run_dir} is in use by another run: {_describe(current)} holds {path}; wait for it "
                        f"to finish, or remove the lock file if that run is gone"
                    ) from None
                stale = path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex[:8]}")
                try:
                    os.rename(path, stale)
                except FileNotFoundError:
                    continue  # another process took it over first; try again
                stale.unlink(missing_ok=True)
                if warn is not None:
                    warn(f"took over the lock of {run_dir} from {_describe(current)}, which is no longer running")
                continue
            except OSError as error:
                raise UsageError(f"cannot create the lock file {path}: {error.strerror}") from None
            try:
                os.write(fd, json.dumps(holder).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            return cls(path, holder)
        raise UsageError(f"{run_dir}: could not take the lock {path} (other processes keep taking it)")

    def release(self) -> None:
        """Remove the lock file, if it is still this lock's."""
        if self.storage is not None:
            if (_read_stored(self.storage) or {}).get("run") == self.run_id:
                self.storage.delete([LOCK_NAME])
            return
        if self.path is None:
            return
        current = _read(self.path)
        if current is not None and current.get("run") == self.run_id:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: Path) -> dict | None:
    try:
        document = json.loads(read_regular(path, 4096).decode("utf-8"))
    except (DataCheckError, OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _acquire_stored(storage: Storage, *, warn: Callable[[str], None] | None, run_id: str | None) -> RunLock:
    identity = process_identity()
    holder = {**identity, "run": run_id or run_id_of(identity)}
    where = storage.where(LOCK_NAME)
    for _ in range(3):
        if storage.create_exclusive(LOCK_NAME, json.dumps(holder).encode() + b"\n"):
            return RunLock(None, holder, storage)
        current = _read_stored(storage)
        if current is None and storage.size(LOCK_NAME) is None:
            continue  # released in between
        if current is None or not seen_from_here(current) or holder_alive(current):
            raise UsageError(
                f"{storage.root} is in use by another run: {_describe(current)} holds {where}; wait for it "
                f"to finish, or remove that object if that run is gone"
            )
        storage.delete([LOCK_NAME])
        if warn is not None:
            warn(f"took over the lock of {storage.root} from {_describe(current)}, which is no longer running")
    raise UsageError(f"{storage.root}: could not take the lock {where} (other processes keep taking it)")


def _read_stored(storage: Storage) -> dict | None:
    try:
        document = json.loads(storage.read(LOCK_NAME)[:4096].decode("utf-8"))
    except (DataCheckError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None
