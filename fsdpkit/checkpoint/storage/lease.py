"""One writer per destination in a storage: the marker of a write under way, WRITING_MARKER, is
also the writer's lease. It is made with the storage's conditional create (`If-None-Match: *`
in an object store) and names its holder (host, process-id namespace, pid, start time); the
holder rewrites it every `beat_seconds` while it writes.

A second writer that finds the marker is refused while its holder lives: on this host (its name
and process-id namespace), while that process runs; from elsewhere, while the marker keeps
changing (it is watched for MISSED_BEATS of the holder's beats). A marker whose holder is gone,
a killed writer's or one a writer left emptied when it stopped (what an interrupted write
leaves, which the next write replaces), is taken over: deleted, then made again. That is a
check, then a delete: two writers taking over the same stale marker in the same instant may
both proceed, as with the run lock. A holder taken over (its beats had stopped) learns it at its
next beat or at `check`, which the writes call just before their commit object: it commits
nothing, and leaves the marker to the new holder.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

from ... import log
from ...errors import FsdpkitError, RunError, UsageError
from ...holder import holder_alive, process_identity, seen_from_here
from .face import Storage

WRITING_MARKER = ".fsdpkit-writing"  # present while a write is under way, or after one was cut short
BEAT_SECONDS = 5.0  # the holder rewrites the marker this often
MISSED_BEATS = 3  # a marker from another host unchanged for this many of its beats is a gone holder's
LONGEST_BEAT_SECONDS = 60.0  # a marker's own beat is trusted up to this


class WriterLease:
    """The lease this process holds on a storage's destination (`take`), until `release`."""

    def __init__(self, storage: Storage, holder: dict, *, found_marker: bool):
        self.storage, self.holder = storage, holder
        self.found_marker = found_marker  # a marker was there before: a gone holder's, or an interrupted write's
        self._stop, self._lost = threading.Event(), threading.Event()
        self._beats = threading.Thread(target=self._beat, name="fsdpkit-lease", daemon=True)
        self._beats.start()

    @classmethod
    def take(cls, storage: Storage, *, beat_seconds: float = BEAT_SECONDS) -> WriterLease:
        """The lease on `storage`; a UsageError naming the holder while another writer holds it."""
        holder = {**process_identity(), "lease": uuid.uuid4().hex, "beat_seconds": beat_seconds, "beat": 0}
        for attempt in range(3):
            if storage.create_exclusive(WRITING_MARKER, _encoded(holder)):
                return cls(storage, holder, found_marker=attempt > 0)
            found = _read(storage)
            if found is not None and _holder_lives(storage, found):
                raise UsageError(held_line(storage, found))
            storage.delete([WRITING_MARKER])
        raise UsageError(f"could not take {storage.where(WRITING_MARKER)}: other fsdpkit commands keep taking it; nothing written")

    def _beat(self) -> None:
        while not self._stop.wait(self.holder["beat_seconds"]):
            try:
                if not self._still_ours():  # taken over: the marker is the new holder's to keep
                    self._lost.set()
                    return
                self.holder["beat"] += 1
                self.storage.put(WRITING_MARKER, _encoded(self.holder))
            except (FsdpkitError, OSError):  # a missed beat is tried again at the next
                continue

    def _still_ours(self) -> bool:
        """Whether the marker still names this lease; a store's error is raised."""
        try:
            found = _holder_in(self.storage.read(WRITING_MARKER))
        except FsdpkitError:
            if self.storage.size(WRITING_MARKER) is None:
                return False
            raise
        return found is not None and found.get("lease") == self.holder["lease"]

    def check(self) -> None:
        """A RunError when another command took the lease over (this one's beats had stopped for
        MISSED_BEATS of them): what would make the write whole is not written."""
        if not self._lost.is_set() and not self._still_ours():
            self._lost.set()
        if self._lost.is_set():
            raise RunError(
                f"{self.storage.where(WRITING_MARKER)}: another fsdpkit command took the destination over while this one "
                f"was stalled (its beats stopped for {MISSED_BEATS} of them); nothing committed"
            )

    def release(self, *, interrupted: bool) -> None:
        """Stop holding the lease: the marker removed, or, where the write is `interrupted`
        (what it wrote stays for the next write to replace or continue), left emptied; a lease
        taken over leaves the marker to its new holder."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._beats.join()
        if self._lost.is_set():
            return
        if interrupted:
            self.storage.put(WRITING_MARKER, b"")
        else:
            self.storage.delete([WRITING_MARKER])

    def __enter__(self) -> WriterLease:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(FsdpkitError, OSError):  # the failure that ended the block is the one to report
            self.release(interrupted=True)


def refuse_if_held(storage: Storage) -> None:
    """A UsageError naming the holder while another writer holds `storage`'s lease; else nothing."""
    found = _read(storage)
    if found is not None and _holder_lives(storage, found):
        raise UsageError(held_line(storage, found))


def held_line(storage: Storage, holder: dict) -> str:
    return (
        f"destination {storage.root} is being written by another fsdpkit command (pid {holder.get('pid')} on "
        f"{holder.get('host')} holds {storage.where(WRITING_MARKER)}): wait for it to finish; nothing written"
    )


def _encoded(holder: dict) -> bytes:
    return json.dumps(holder).encode() + b"\n"


def _read(storage: Storage) -> dict | None:
    """The holder the marker names; None when there is no marker, or it names no holder."""
    try:
        return _holder_in(storage.read(WRITING_MARKER))
    except FsdpkitError:
        return None


def _holder_in(marker: bytes) -> dict | None:
    """The holder a marker's bytes name; None for an emptied or unreadable one."""
    try:
        document = json.loads(marker[:4096].decode("utf-8") or "null")
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) and "lease" in document else None


def _holder_lives(storage: Storage, found: dict) -> bool:
    """Whether the holder `found` is still writing: its process runs (this host), or its marker
    changes within MISSED_BEATS of its beats (another host)."""
    if seen_from_here(found):
        return holder_alive(found)
    beat = found.get("beat_seconds")
    beat = min(float(beat), LONGEST_BEAT_SECONDS) if isinstance(beat, (int, float)) and beat > 0 else BEAT_SECONDS
    deadline = time.monotonic() + MISSED_BEATS * beat
    log.note(
        f"{storage.where(WRITING_MARKER)} names pid {found.get('pid')} on {found.get('host')}: watching it for "
        f"{MISSED_BEATS * beat:g} s to tell whether that write still runs"
    )
    while time.monotonic() < deadline:
        time.sleep(min(beat / 4, 1.0))
        now = _read(storage)
        if now != found:  # a beat, or another writer's marker: a live holder; none: released
            return now is not None
    return False
