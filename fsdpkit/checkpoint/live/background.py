"""What keeps a save off the training step: host buffers the snapshot is copied into, reused
by every save; the lower OS priority of the thread that writes; and the counters that show
where a save's time goes (`SaveTimings`).

An async save copies this rank's tensors into `HostBuffers` in one pass, in the training
thread, before `Checkpointer.save` returns (so training may change them at once); the
background thread then writes and checksums from there in `WRITE_CHUNK_BYTES` pieces (both
release the GIL), at nice +10. The next save waits for the previous one before it copies, so
one set of buffers is enough; they are allocated on the first save and again only when the
table of tensors changes.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

WRITE_CHUNK_BYTES = 8 * 1024 * 1024  # one os.write and one crc32 update: the longest the writer holds on to anything
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
    """One flat host tensor per dtype holding a copy of named 1-D tensors, reused while the
    names, dtypes and sizes stay the same. Pinned when the tensors live on a GPU."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._views: dict[str, torch.Tensor] = {}
        self._key: tuple | None = None

    def copy(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy every tensor into the buffers (allocating them if the table changed); returns
        the host views, by name. The copies are complete when this returns."""
        key = tuple((name, tensor.dtype, tensor.numel()) for name, tensor in tensors.items())
        if key != self._key:
            self._allocate(tensors)
            self._key = key
        on_device = False
        with torch.no_grad():
            for name, tensor in tensors.items():
                on_device = on_device or tensor.device.type != "cpu"
                self._views[name].copy_(tensor.detach().reshape(-1), non_blocking=tensor.device.type == "cuda")
        if on_device and torch.cuda.is_available():
            torch.cuda.synchronize()
        return dict(self._views)

    def _allocate(self, tensors: dict[str, torch.Tensor]) -> None:
        sizes: dict[torch.dtype, int] = {}
        for tensor in tensors.values():
            sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + tensor.numel()
        pin = torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values())
        self.buffers = {dtype: torch.empty(size, dtype=dtype, pin_memory=pin) for dtype, size in sizes.items()}
        offsets = dict.fromkeys(sizes, 0)
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
