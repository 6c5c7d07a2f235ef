"""What keeps a save off the training step: host buffers the snapshot is copied into, reused
by every save; the lower OS priority of the thread that writes; and the counters that show
where a save's time goes (`SaveTimings`).

An async save copies this rank's tensors into `HostBuffers`, allocated when the run starts,
in the order copy_order.py gives (from a GPU on a stream of its own, which the next optimizer
step waits for); the background thread then writes and checksums from there in
`WRITE_CHUNK_BYTES` pieces (both release the GIL), at nice +10. The next save waits for the
previous one before it copies, so one set of buffers is enough.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

WRITE_CHUNK_BYTES = 32 * 1024 * 1024  # one os.write and one crc32 update, each without the GIL; fewer pieces, fewer GIL hand-overs
BACKGROUND_NICENESS = 10


@dataclass
class SaveTimings:
    """Seconds this rank spent on saves so far, summed over `saves`. `snapshot` is copying the
    tensors to host memory (into HostBuffers, or fragment by fragment from a device); `checksum`
    crc32; `write` os.write; `fsync` the rank file's fsync; `total` the whole saves (snapshot,
    collectives and commit included; for async saves mostly in the background)."""

    saves: int = 0
    snapshot: float = 0.0
    checksum: float = 0.0
    write: float = 0.0
    fsync: float = 0.0
    total: float = 0.0


class HostBuffers:
    """One flat host tensor per dtype holding the copies of named 1-D tensors, each a view of
    it, reused while the names, dtypes and sizes stay the same. `reserve` allocates them when
    the run starts (pinned for a GPU, every page touched), so that no snapshot pays for it; a
    table that outgrows them allocates again."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._key: tuple | None = None
        self._pin = False

    def reserve(self, numels: dict[torch.dtype, int], *, pin: bool) -> None:
        """Allocate room for `numels` elements of each dtype now."""
        self._pin = pin and torch.cuda.is_available()
        self.buffers = {dtype: self._allocate(dtype, numel) for dtype, numel in numels.items()}

    def views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host view each tensor is copied into, by name (allocating room the buffers lack)."""
        key = tuple((name, tensor.dtype, tensor.numel()) for name, tensor in tensors.items())
        if key != self._key:
            self._carve(tensors)
            self._key = key
        return dict(self._views)

    def _allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, pin_memory=self._pin)
        if not self._pin:
            buffer.zero_()  # the first copy into it should not fault its pages in
        return buffer

    def _carve(self, tensors: dict[str, torch.Tensor]) -> None:
        numels: dict[torch.dtype, int] = {}
        for tensor in tensors.values():
            numels[tensor.dtype] = numels.get(tensor.dtype, 0) + tensor.numel()
        self._pin = self._pin or (torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values()))
        for dtype, numel in numels.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() < numel:
                self.buffers[dtype] = self._allocate(dtype, numel)
        offsets = dict.fromkeys(numels, 0)
        self._views = {}
        for name, tensor in tensors.items():
            start = offsets[tensor.dtype]
            self._views[name] = self.buffers[tensor.dtype][start : start + tensor.numel()]
            offsets[tensor.dtype] = start + tensor.numel()


def lower_thread_priority() -> None:
    """Make the calling thread 10 nicer than it is (Linux applies setpriority to one thread by
    its id); where that is not possible the thread keeps its priority."""
    try:
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICENESS))
    except (AttributeError, OSError):
        pass
