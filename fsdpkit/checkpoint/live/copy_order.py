"""The device-to-host copy of a snapshot or an async save, overlapped with training.

The order, on the device's streams (`Streams`: CUDA's, or the host's, where everything runs at
once in the calling thread):

1. the training thread copies the buffers on the training stream (the next forward may change
   them: BatchNorm's running statistics), makes the copy stream wait for the training stream
   (so the copies see the optimizer step just taken), queues the parameters' and optimizer
   states' copies on the copy stream, records an event after them, and goes on;
2. the writer thread waits for that event before it reads the host buffers;
3. the next optimizer step makes the training stream wait for the event before it changes a
   parameter (`guard` installs this as the optimizer's step pre-hook): the training thread
   itself never waits.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch

from .background import HostBuffers


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread until the work recorded before the event is done."""


class Streams(Protocol):
    """The stream operations a copy is ordered with."""

    def copy_on_training(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def copy_waits_for_training(self) -> None: ...

    def copy_on_copy_stream(self, dst: torch.Tensor, src: torch.Tensor) -> None: ...

    def record_on_copy_stream(self) -> Event: ...

    def training_waits_for(self, event: Event) -> None: ...


class DoneEvent:
    def synchronize(self) -> None:
        pass


class HostStreams:
    """No device: each copy runs in the calling thread (torch copies release the GIL)."""

    def copy_on_training(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def copy_waits_for_training(self) -> None:
        pass

    def copy_on_copy_stream(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_on_copy_stream(self) -> Event:
        return DoneEvent()

    def training_waits_for(self, event: Event) -> None:
        pass


class CudaStreams:
    """The training thread's current stream, and a copy stream of its own on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device)

    def copy_on_training(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

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


def streams_for(device: torch.device) -> Streams:
    return CudaStreams(device) if device.type == "cuda" else HostStreams()


class OverlappedCopy:
    """Copies named tensors into `buffers` in the order above; at most one copy guarded at a time."""

    def __init__(self, buffers: HostBuffers, streams: Streams) -> None:
        self.buffers = buffers
        self.streams = streams
        self.unguarded: Event | None = None  # the last copy's event, until an optimizer step waits for it

    def start(
        self, tensors: dict[str, torch.Tensor], *, on_training: frozenset[str] = frozenset()
    ) -> tuple[dict[str, torch.Tensor], Event]:
        """Queue the copies (`on_training`: the names copied on the training stream); returns the
        host views by name, valid once the event is done."""
        host = self.buffers.views(tensors)
        streams = self.streams
        with torch.no_grad():
            for name in on_training:
                streams.copy_on_training(host[name], tensors[name].detach().reshape(-1))
            streams.copy_waits_for_training()
            for name, tensor in tensors.items():
                if name not in on_training:
                    streams.copy_on_copy_stream(host[name], tensor.detach().reshape(-1))
        event = streams.record_on_copy_stream()
        self.unguarded = event
        return host, event

    def before_update(self) -> None:
        """What the next optimizer step does first: the training stream waits for the copy."""
        if self.unguarded is not None:
            self.streams.training_waits_for(self.unguarded)
            self.unguarded = None

    def guard(self, optimizer: torch.optim.Optimizer) -> None:
        """Make `before_update` the optimizer's step pre-hook (holding no reference to the
        buffers: they go with this object)."""
        this = weakref.ref(self)

        def wait_for_copy(*_: object) -> None:
            copy = this()
            if copy is not None:
                copy.before_update()

        optimizer.register_step_pre_hook(wait_for_copy)
