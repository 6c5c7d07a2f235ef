"""Who holds a lock: this process's identity (host, process-id namespace, pid, kernel start
time), whether this process can tell if a recorded holder still runs (`seen_from_here`), and
whether it does (`holder_alive`) (no torch)."""

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


def _pid_namespace() -> str | None:
    """This process's process-id namespace (`pid:[4026531836]`), where /proc has it."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity() -> dict:
    """host, process-id namespace, pid and start time of this process: what a lock records."""
    pid = os.getpid()
    started = _start_time(_stat(pid)) or f"t{time.time():.0f}"
    return {"host": socket.gethostname(), "pid_ns": _pid_namespace(), "pid": pid, "started": started}


def seen_from_here(holder: dict) -> bool:
    """Whether this process can tell if `holder` still runs: it ran on this host, in this
    process-id namespace (containers on one host may share its name, not its processes); a
    holder that recorded no namespace is taken to be in this one."""
    ours = _pid_namespace()
    return holder.get("host") == socket.gethostname() and holder.get("pid_ns", ours) == ours


def run_id_of(identity: dict) -> str:
    return f"{identity['host']}-{identity['pid']}-{identity['started']}"


def holder_alive(holder: dict) -> bool:
    """Whether the holder of a lock `seen_from_here` is still the process that took it."""
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
