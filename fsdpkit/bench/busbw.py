"""Bandwidth arithmetic of collective benchmarks, as nccl-tests defines it. No process group.

    algbw = size / time                     (GB/s, GB = 1e9 bytes)
    busbw = algbw * factor(n)               (n = number of ranks)

`size` is the total array size S in bytes: for all-gather the full gathered output, for
reduce-scatter the full input, for all-reduce / broadcast the buffer, for all-to-all one
rank's whole send buffer. The factor makes busbw comparable to the hardware's link speed
whatever n is (nccl-tests doc/PERFORMANCE.md):

    allreduce       2(n-1)/n
    allgather       (n-1)/n
    reducescatter   (n-1)/n
    alltoall        (n-1)/n
    broadcast       1

Valid sizes follow nccl-tests too: for the sharded collectives (all-gather, reduce-scatter,
all-to-all) the per-rank element count is (size / element size / n) rounded down to a
multiple of 16 bytes, and the size becomes count * element size * n; for all-reduce and
broadcast the count is size / element size rounded down.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ..errors import UsageError
from ..sizes import format_size

COLLECTIVES = ("allgather", "reducescatter", "allreduce", "broadcast", "alltoall")
# Collectives with several implementations to compare; the first is the default, "all" runs them all.
VARIANTS = {
    "allgather": ("flat", "list", "fsdpkit"),  # all_gather_single (FSDP's) / into a list of tensors / Collectives.all_gather
    "reducescatter": ("torch", "fsdpkit"),  # torch's reduce_scatter_single / fsdpkit's Collectives.reduce_scatter
}
SHARDED_COLLECTIVES = frozenset({"allgather", "reducescatter", "alltoall"})
MODES = ("out_of_place", "in_place")  # nccl-tests: separate buffers, or send inside receive
ALIGNMENT_BYTES = 16  # nccl-tests rounds each rank's share down to this many bytes

ALGBW_FORMULA = "algbw = size / time"
BUSBW_FORMULAS = MappingProxyType(
    {
        "allreduce": "busbw = algbw * 2(n-1)/n",
        "allgather": "busbw = algbw * (n-1)/n",
        "reducescatter": "busbw = algbw * (n-1)/n",
        "alltoall": "busbw = algbw * (n-1)/n",
        "broadcast": "busbw = algbw * 1",
    }
)


def check_collective(collective: str) -> str:
    if collective not in COLLECTIVES:
        raise UsageError(f"unknown collective {collective!r}: choose from {', '.join(COLLECTIVES)}")
    return collective


def busbw_factor(collective: str, world_size: int) -> float:
    """The factor busbw = algbw * factor, for `world_size` ranks."""
    check_collective(collective)
    if world_size < 1:
        raise UsageError(f"world size must be >= 1, got {world_size}")
    n = world_size
    if collective == "allreduce":
        return 2 * (n - 1) / n
    if collective == "broadcast":
        return 1.0
    return (n - 1) / n


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second)."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds} s")
    return size_bytes / seconds / 1e9


def busbw_gbps(collective: str, world_size: int, size_bytes: int, seconds: float) -> float:
    return algbw_gbps(size_bytes, seconds) * busbw_factor(collective, world_size)


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """min, min*factor, min*factor^2, ... up to and including max (nccl-tests -b/-e/-f)."""
    if min_bytes < 1:
        raise UsageError(f"--min-bytes must be at least 1 byte, got {min_bytes}")
    if min_bytes > max_bytes:
        raise UsageError(
            f"--min-bytes {min_bytes} ({format_size(min_bytes)}) is larger than --max-bytes {max_bytes} ({format_size(max_bytes)})"
        )
    if factor < 2:
        raise UsageError(f"--factor must be an integer >= 2, got {factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


@dataclass(frozen=True)
class BenchSize:
    """One row of the table: the total size S in bytes and the count column."""

    size_bytes: int
    count: int  # elements per rank for sharded collectives (nccl-tests' count), else the buffer's


def valid_size(collective: str, requested_bytes: int, world_size: int, element_size: int) -> BenchSize:
    """Round a requested size down to one the collective can run (see the module docstring)."""
    check_collective(collective)
    if collective in SHARDED_COLLECTIVES:
        unit = max(1, ALIGNMENT_BYTES // element_size)
        count = (requested_bytes // element_size // world_size) // unit * unit
        return BenchSize(size_bytes=count * element_size * world_size, count=count)
    count = requested_bytes // element_size
    return BenchSize(size_bytes=count * element_size, count=count)


def smallest_valid_bytes(collective: str, world_size: int, element_size: int) -> int:
    if collective in SHARDED_COLLECTIVES:
        return max(ALIGNMENT_BYTES, element_size) * world_size
    return element_size


def bench_sizes(collective: str, requested: list[int], world_size: int, element_size: int) -> list[BenchSize]:
    """Valid sizes for `requested`, in order, without the ones that round to zero or repeat."""
    sizes: list[BenchSize] = []
    for requested_bytes in requested:
        size = valid_size(collective, requested_bytes, world_size, element_size)
        if size.count > 0 and (not sizes or sizes[-1] != size):
            sizes.append(size)
    if not sizes:
        smallest = smallest_valid_bytes(collective, world_size, element_size)
        raise UsageError(
            f"--max-bytes {max(requested)} is too small for {collective} over {world_size} ranks "
            f"with {element_size}-byte elements: the smallest valid size is {smallest} bytes"
        )
    return sizes
