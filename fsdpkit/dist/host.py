"""What this machine has: memory available to new allocations (for checks before launch); this
process's peak resident memory, its main thread's CPU time and waits for a core."""

from __future__ import annotations

import os
import resource


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> int:
    """The peak RSS of this process's own address space (Linux's VmHWM; ru_maxrss, the fallback,
    survives fork and exec, so it would count the process this one was started from)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def thread_cpu_seconds() -> float:
    """The CPU time (user and system) of the calling thread alone (Linux); 0.0 where there is no
    per-thread count."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return 0.0
    used = resource.getrusage(who)
    return used.ru_utime + used.ru_stime


def run_delay_seconds() -> float:
    """How long this process's main thread has been ready to run but waiting for a core (Linux's
    schedstat; 0.0 where there is none): what a loaded machine adds to its wall time."""
    try:
        with open("/proc/self/schedstat", encoding="ascii") as schedstat:
            return int(schedstat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
