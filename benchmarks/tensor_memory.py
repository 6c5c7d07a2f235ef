"""Peak bytes of live torch tensors while a system trains, on CUDA and on CPU.

CUDA: torch.cuda.max_memory_allocated after a reset, minus what was allocated before the
system was built (the caching allocator's reserve is not counted).

CPU has no allocator statistics, and peak RSS only grows (and glibc keeps freed pages), so
the CPU measure replays the profiler's allocation events instead: every tensor allocation
and free, with its size, in order. Their running sum from before the system is built is
the bytes this system holds; a marker allocation separates building from training, and
the peak is taken over training only. Exact, but profiling slows the run: use it in a
separate, untimed trial.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

MARKER_BYTES = 7_654_321  # an odd size no real tensor here has


def peak_training_bytes(build: Callable[[], Any], train: Callable[[Any], Any], device: torch.device) -> tuple[Any, int, int]:
    """Build a system, train it; return (what train returned, peak bytes while training,
    bytes held when training started), counting only tensors allocated from the build on."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        system = build()
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        result = train(system)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del system
        return result, peak, start
    return _cpu_peak(build, train)


def _cpu_peak(build: Callable[[], Any], train: Callable[[Any], Any]) -> tuple[Any, int, int]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        system = build()
        marker = torch.empty(MARKER_BYTES, dtype=torch.uint8)
        del marker
        result = train(system)
        del system
    sizes = _allocation_sizes(prof)
    running, start, peak, training = 0, 0, 0, False
    for size in sizes:
        if not training and size == MARKER_BYTES:
            training, start, peak = True, running, running
            continue
        if training and size == -MARKER_BYTES:
            continue
        running += size
        if training:
            peak = max(peak, running)
    if not training:
        raise RuntimeError("the profiler recorded no marker allocation: cannot separate building from training")
    return result, peak, start


def _allocation_sizes(prof: Any) -> list[int]:
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    events.sort(key=lambda event: event[0])
    return [size for _, size in events]
