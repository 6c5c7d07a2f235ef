"""Who holds a lock: this process's identity (host, pid, kernel start time), and whether a
holder recorded on this host is still the process that took the lock (no torch)."""

from __future__ import annotations

import os
import socket
import time


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name (its state first), where /proc has them."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _start_time(stat: list[bytes]) -> str | None:
    """The kernel's start time of a process (clock ticks since boot), from its `_stat`."""
    return stat[19].decode() if len(stat) > 19 else None


def process_identity() -> dict:
    """host, pid and start time of this process: what a lock records."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(_stat(pid)) or f"t{time.time():.0f}"}


def run_id_of(identity: dict) -> str:
    return f"{identity['host']}-{identity['pid']}-{identity['started']}"


def holder_alive(holder: dict) -> bool:
    """Whether the holder of a lock on this host is still the process that took it."""
    pid = holder.get("pid")
    if type(pid) is not int or pid <= 0:
        return True  # cannot tell: treat as held
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    stat = _stat(pid)
    if stat[:1] in ([b"Z"], [b"X"]):
        return False  # it exited; its parent has not reaped it yet
    started = _start_time(stat)
    return started is None or started == holder.get("started")
