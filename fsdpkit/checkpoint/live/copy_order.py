"""The device-to-host copy of a snapshot or an async save, overlapped with training, into host
buffers allocated when the run starts. The order, on the device's streams (CUDA's, or the
host's, where everything runs at once in the calling thread):

1. the training thread copies the buffers on the training stream (the next forward may change
   them: BatchNorm's running statistics), makes the copy stream wait for the training stream
   (to see the optimizer step just taken), queues the other copies on the copy stream, records
   an event after them, and goes on;
2. the writer thread waits for that event before it reads the host buffers;
3. the next optimizer step (`guard`: its step pre-hook) makes the training stream wait for the
   event before it changes a parameter: the training thread itself never waits.
"""

from __future__ import annotations

import weakref
from collections import Counter

import torch
import torch.nn as nn

from ...engine.view import ShardedModelView
from .model_state import planned_numels


class DoneEvent:
    """The event of copies that ran in the calling thread: done when recorded."""

    def synchronize(self) -> None:
        pass


Event = DoneEvent | torch.cuda.Event  # synchronize() blocks until the work recorded before it is done


class HostBuffers:
    """One flat host tensor per dtype holding the copies of named 1-D tensors, each a view of
    it. `reserve` allocates them when the run starts (pinned for a GPU, every page touched), so
    that no snapshot pays for it; a table that outgrows them allocates again."""

    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self._pin = False

    def reserve(self, numels: dict[torch.dtype, int], *, pin: bool) -> None:
        self._pin = pin and torch.cuda.is_available()
        self.buffers = {dtype: self._allocate(dtype, numel) for dtype, numel in numels.items()}

    def views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The host view each tensor is copied into, by name (allocating room the buffers lack)."""
        numels: Counter[torch.dtype] = Counter()
        starts = {}
        for name, tensor in tensors.items():
            starts[name] = numels[tensor.dtype]
            numels[tensor.dtype] += tensor.numel()
        self._pin = self._pin or (torch.cuda.is_available() and any(t.device.type == "cuda" for t in tensors.values()))
        for dtype, numel in numels.items():
            if dtype not in self.buffers or self.buffers[dtype].numel() < numel:
                self.buffers[dtype] = self._allocate(dtype, numel)
        return {name: self.buffers[t.dtype][starts[name] : starts[name] + t.numel()] for name, t in tensors.items()}

    def _allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, pin_memory=self._pin)
        if not self._pin:
            buffer.zero_()  # the first copy into it should not fault its pages in
        return buffer


class HostStreams:
    """The stream operations a copy is ordered with; with no device, each runs in the calling thread."""

    def copy_on_training(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # on a CUDA stream, queued; between host tensors, done

    def copy_waits_for_training(self) -> None:
        pass

    def copy_on_copy_stream(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_on_copy_stream(self) -> Event:
        return DoneEvent()

    def training_waits_for(self, event: Event) -> None:
        pass


class CudaStreams(HostStreams):
    """The training thread's current stream, and a copy stream of its own on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def copy_waits_for_training(self) -> None:
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_on_copy_stream(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
        if src.device.type == "cuda":
            src.record_stream(self.copy_stream)  # a temporary source is not reused before its copy is done

    def record_on_copy_stream(self) -> Event:
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def training_waits_for(self, event: Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)  # type: ignore[arg-type]


class OverlappedCopy:
    """Copies named tensors into `buffers` in the order above; at most one copy guarded at a time."""

    def __init__(self, buffers: HostBuffers, streams: HostStreams) -> None:
        self.buffers = buffers
        self.streams = streams
        self.unguarded: Event | None = None  # the last copy's event, until an optimizer step waits for it

    @classmethod
    def reserved(cls, view: ShardedModelView, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> OverlappedCopy:
        """The copy of this rank's checkpoint data into buffers allocated now, when the run starts."""
        buffers = HostBuffers()
        buffers.reserve(planned_numels(view, module, optimizer), pin=view.device.type == "cuda")
        copy = cls(buffers, CudaStreams(view.device) if view.device.type == "cuda" else HostStreams())
        if optimizer is not None:
            copy.guard(optimizer)
        return copy

    def start(
        self, tensors: dict[str, torch.Tensor], *, on_training: frozenset[str] = frozenset()
    ) -> tuple[dict[str, torch.Tensor], Event]:
        """Queue the copies (`on_training`: the names copied on the training stream); returns the
        host views by name, valid once the event is done."""
        host = self.buffers.views(tensors)
        with torch.no_grad():
            for name in on_training:
                self.streams.copy_on_training(host[name], tensors[name].detach().reshape(-1))
            self.streams.copy_waits_for_training()
            for name, tensor in tensors.items():
                if name not in on_training:
                    self.streams.copy_on_copy_stream(host[name], tensor.detach().reshape(-1))
        self.unguarded = self.streams.record_on_copy_stream()
        return host, self.unguarded

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the optimizer's next step wait for the copy, on the training stream (its step
        pre-hook holds no reference to the buffers: they go with this object)."""
        this = weakref.ref(self)

        def wait_for_copy(*_: object) -> None:
            copy = this()
            if copy is not None and copy.unguarded is not None:
                copy.streams.training_waits_for(copy.unguarded)
                copy.unguarded = None

        optimizer.register_step_pre_hook(wait_for_copy)
