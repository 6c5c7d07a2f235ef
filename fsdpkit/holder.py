"""Who holds a lock: this process's identity (host, pid, kernel start time), and whether a
holder recorded on this host is still the process that took the lock (no torch)."""

from __future__ import annotations

import os
import socket
import time


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process `pid` (clock ticks since boot), where /proc has it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def process_identity() -> dict:
    """host, pid and start time of this process: what a lock records."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": _start_time(pid) or f"t{time.time():.0f}"}


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
    started = _start_time(pid)
    return started is None or started == holder.get("started")
