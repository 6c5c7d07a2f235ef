"""The processes of a running `fsdpkit train`, found through /proc; a run killed as a whole."""

from __future__ import annotations

import contextlib
import os
import signal
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
