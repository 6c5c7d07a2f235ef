"""The processes of a running `fsdpkit train`, found through /proc; a run killed as a whole; the
named semaphores a run left in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def workers(launcher: int) -> list[int]:
    """The launcher's worker processes: the children of its fork server (not its resource
    tracker)."""
    found = []
    for pid in children(launcher):
        command = _command_line(pid)
        if "multiprocessing.forkserver" in command:
            found += children(pid)
        elif "resource_tracker" not in command:
            found.append(pid)
    return found


def children(pid: int) -> list[int]:
    try:
        return [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]
    except OSError:  # gone meanwhile
        return []


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def kill_run(group: int) -> None:
    """SIGKILL every live process of process group `group` (a run started in a session of its own)
    but multiprocessing's resource tracker: once the last of the others is gone it removes the
    named semaphores they left (torch elastic's queues and events, in /dev/shm) and exits. Killed
    with the rest, it would leave them there."""
    while members := [pid for pid in _live_members(group) if "resource_tracker" not in _command_line(pid)]:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _live_members(group: int) -> list[int]:
    """The processes of process group `group` that are not zombies (a killed one not yet reaped)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and int(fields[2]) == group:
            found.append(int(entry.name))
    return found


SHM = Path("/dev/shm")
SETTLE_SECONDS = 2.0  # a resource tracker removes what its processes left once the last one is gone


def semaphores() -> set[str]:
    """multiprocessing's named semaphores now in /dev/shm."""
    return {path.name for path in SHM.glob("sem.mp-*")} if SHM.is_dir() else set()


def leaked_semaphores(before: set[str]) -> list[str]:
    """The named semaphores made since `before` that no live process maps, still there after
    SETTLE_SECONDS: left for good (one that another test's run uses is mapped by its processes)."""
    unmapped = semaphores() - before - _mapped_semaphores()
    if unmapped:
        time.sleep(SETTLE_SECONDS)
        unmapped &= semaphores() - _mapped_semaphores()
    return sorted(unmapped)


def _mapped_semaphores() -> set[str]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                maps = (entry / "maps").read_text()
            except OSError:  # gone meanwhile, or not ours to read
                continue
            found.update(line.rsplit("/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/sem.mp-" in line)
    return found
