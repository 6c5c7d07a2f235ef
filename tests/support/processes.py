"""The processes of a running `fsdpkit train`, found through /proc."""

from __future__ import annotations

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
