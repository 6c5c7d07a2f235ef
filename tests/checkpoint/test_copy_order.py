"""The device-to-host copy's order (copy_order.py) on a fake device: its copy stream runs a
queued copy only when something waits for it, as a busy GPU may. The host copy must hold the
parameters as the snapshot's step left them, although the training thread never waited and
the next optimizer step changed them; and the host buffers exist before the first copy."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdpkit.checkpoint.live.background import HostBuffers
from fsdpkit.checkpoint.live.copy_order import OverlappedCopy


class FakeEvent:
    def __init__(self, device: FakeDevice, index: int) -> None:
        self.device, self.index = device, index

    def synchronize(self) -> None:
        self.device.log.append("writer waits for the event")
        self.device.run_until(self.index)


class FakeDevice:
    """Training-stream work runs at once; the copy stream's queue runs when an event is waited for."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.ran = 0

    def run_until(self, index: int) -> None:
        while self.ran < index:
            dst, src = self.queue[self.ran]
            dst.copy_(src)  # reads the source when the device gets to it, not when it was queued
            self.ran += 1

    def copy_on_training(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append("buffer copied on the training stream")
        dst.copy_(src)

    def copy_waits_for_training(self) -> None:
        self.log.append("copy stream waits for the training stream")

    def copy_on_copy_stream(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.log.append("copy queued")
        self.queue.append((dst, src))

    def record_on_copy_stream(self) -> FakeEvent:
        self.log.append("event recorded")
        return FakeEvent(self, len(self.queue))

    def training_waits_for(self, event: FakeEvent) -> None:
        self.log.append("training stream waits for the event")
        self.run_until(event.index)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 4, generator=generator)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_next_optimizer_step_waits_for_the_copy_and_the_training_thread_never_does():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    device = FakeDevice()
    buffers = HostBuffers()
    numel = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    buffers.reserve({torch.float32: numel, torch.int64: 1}, pin=False)
    reserved = {dtype: b.data_ptr() for dtype, b in buffers.buffers.items()}
    copy = OverlappedCopy(buffers, device)
    copy.guard(optimizer)
    optimizer.register_step_post_hook(lambda *_: device.log.append("optimizer stepped"))
    _step(model, optimizer, 1)
    device.log.clear()

    tensors = dict(model.state_dict())
    snapshot = {name: t.detach().clone() for name, t in tensors.items()}  # what the copy must hold
    buffer_names = frozenset(name for name, _ in model.named_buffers())
    host, event = copy.start(tensors, on_training=buffer_names)
    params = len(tensors) - len(buffer_names)
    assert device.ran == 0  # the training thread went on; nothing of the copy stream ran yet
    _step(model, optimizer, 2)  # its forward changes BatchNorm's statistics, its optimizer step the parameters
    event.synchronize()

    assert device.log == [
        *["buffer copied on the training stream"] * len(buffer_names),
        "copy stream waits for the training stream",
        *["copy queued"] * params,
        "event recorded",
        "training stream waits for the event",
        "optimizer stepped",
        "writer waits for the event",
    ]
    for name, expected in snapshot.items():
        assert torch.equal(host[name].reshape(expected.shape), expected), name
        assert not torch.equal(tensors[name], expected), name  # training did change it
    assert {dtype: b.data_ptr() for dtype, b in buffers.buffers.items()} == reserved  # the buffers reserved before it


def test_an_optimizer_step_with_no_copy_in_flight_waits_for_nothing():
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    device = FakeDevice()
    copy = OverlappedCopy(HostBuffers(), device)
    copy.guard(optimizer)
    before = model.weight.detach().clone()
    host, _ = copy.start(dict(model.state_dict()))
    _step(model, optimizer, 1)
    _step(model, optimizer, 2)
    assert device.log.count("training stream waits for the event") == 1
    assert torch.equal(host["weight"].reshape(before.shape), before)
