"""What this machine has: memory available to new allocations (for checks before launch)."""

from __future__ import annotations

import os


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
