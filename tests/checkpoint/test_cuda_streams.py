"""`CudaStreams`, the copy order of copy_order.py on CUDA's streams, against a recording fake of
torch.cuda (streams, events, the current stream): the copy stream waits for the training stream
before its copies, the copies run on the copy stream and keep their device sources for it, the
event is recorded on the copy stream, and the next optimizer step makes the training stream, not
the copy stream, wait for that event. A CPU machine so catches a wait in the wrong direction."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn

from fsdpkit.checkpoint.live.copy_order import CudaStreams, HostBuffers, OverlappedCopy

DEVICE = torch.device("cuda", 0)


class FakeCuda:
    """What CudaStreams calls of torch.cuda, each call written to `log` with the streams it names."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.current = FakeStream(self, "training")
        self.streams = 0

    def Stream(self, device: torch.device) -> FakeStream:  # noqa: N802
        assert device == DEVICE
        self.streams += 1
        return FakeStream(self, "copy")

    def Event(self) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        assert device == DEVICE
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_stream(self, other: FakeStream) -> None:
        self.cuda.log.append(f"{self.name} stream waits for {other.name} stream")

    def wait_event(self, event: FakeEvent) -> None:
        self.cuda.log.append(f"{self.name} stream waits for event {event.number}")


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.number = sum(line.startswith("event") for line in cuda.log) + 1

    def record(self, stream: FakeStream | None = None) -> None:
        self.cuda.log.append(f"event {self.number} recorded on {(stream or self.cuda.current).name} stream")

    def synchronize(self) -> None:
        self.cuda.log.append(f"host waits for event {self.number}")


class FakeDeviceTensor:
    """A tensor on the fake device: a copy into it or out of it is logged with the current stream."""

    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name, self.device = cuda, name, DEVICE

    def copy_(self, src: FakeDeviceTensor, non_blocking: bool = False) -> None:
        assert non_blocking
        self.cuda.log.append(f"{src.name} copied to {self.name} on {self.cuda.current.name} stream")

    def record_stream(self, stream: FakeStream) -> None:
        self.cuda.log.append(f"{self.name} kept for {stream.name} stream")


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    for name in ("Stream", "Event", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_each_stream_waits_for_the_other_in_the_copy_order(cuda):
    streams = CudaStreams(DEVICE)
    assert cuda.streams == 1
    source, host = FakeDeviceTensor(cuda, "param"), FakeDeviceTensor(cuda, "host")
    streams.copy_on_training(host, FakeDeviceTensor(cuda, "buffer"))  # type: ignore[arg-type]
    streams.copy_waits_for_training()
    streams.copy_on_copy_stream(host, source)  # type: ignore[arg-type]
    event = streams.record_on_copy_stream()
    streams.training_waits_for(event)
    assert cuda.current.name == "training"  # the copy stream was current only for its copies
    assert cuda.log == [
        "buffer copied to host on training stream",
        "copy stream waits for training stream",
        "param copied to host on copy stream",
        "param kept for copy stream",
        "event 1 recorded on copy stream",
        "training stream waits for event 1",
    ]


def test_the_next_optimizer_step_makes_the_training_stream_wait_for_the_copy_once(cuda):
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    copy = OverlappedCopy(HostBuffers(), CudaStreams(DEVICE))
    copy.guard(optimizer)
    optimizer.register_step_post_hook(lambda *_: cuda.log.append("optimizer stepped"))
    host, event = copy.start(dict(model.state_dict()))  # host tensors: copied at once, no record_stream
    event.synchronize()
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
    assert cuda.log == [
        "copy stream waits for training stream",
        "event 1 recorded on copy stream",
        "host waits for event 1",
        "training stream waits for event 1",
        "optimizer stepped",
        "optimizer stepped",
    ]
    assert set(host) == {"weight", "bias"}
