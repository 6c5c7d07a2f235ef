"""Copies to host memory that overlap training. The order (copy_order.py) on a fake device,
whose copy stream runs a queued copy only when something waits for it, as a busy GPU may: the
host copy must hold the parameters as the snapshot's step left them, although the training
thread never waited and the next optimizer step changed them; the host buffers exist before
the first copy. Then the snapshot writer and an async save that cannot keep up, one rank on CPU."""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdpkit
from fsdpkit.checkpoint.live.copy_order import HostBuffers, OverlappedCopy
from fsdpkit.checkpoint.live.model_state import tensor_table
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.checkpoint.memory.store import SnapshotStore
from fsdpkit.checkpoint.memory.writer import SnapshotWriter
from fsdpkit.engine.view import describe


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


def _local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """This rank's checkpoint tensors as the model and optimizer hold them now, copied."""
    _, local = tensor_table(describe(model), model, optimizer)
    return {name: (held, data.clone()) for name, (held, data) in local.items()}


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


def test_a_snapshot_holds_its_step_and_one_due_before_every_rank_finished_is_skipped_in_one_line(tmp_path):
    """The real writer, one rank: what it wrote for step 1 is the model and AdamW state as step
    1 left them, though step 2 ran meanwhile; step 2's snapshot, due before the ranks confirmed
    step 1's, is skipped with one line; every copy went into the buffers reserved at the start."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = fsdpkit.shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        store = SnapshotStore.create(tmp_path, run_id="run-a", node_rank=0)
        lines: list[str] = []
        writer = SnapshotWriter(store, model, optimizer, peers=None, warn=lines.append)
        reserved = {dtype: b.data_ptr() for dtype, b in writer.host_buffers.buffers.items()}
        _step(model, optimizer, 1)
        expected = _local_state(model, optimizer)
        _, local = tensor_table(describe(model), model, optimizer)
        writer.offer(1, {})
        _step(model, optimizer, 2)
        writer.offer(2, {})
        writer.wait()
        assert lines == ["snapshot of step 2 skipped: the one of step 1 is not finished on every rank yet"]
        assert store.steps() == [1] and store.refusal(1, 0, 1) is None
        with CheckpointReader(store.step_dir(1), validate_all=False) as reader:  # as a restore reads it
            for name, (held, data) in expected.items():
                assert torch.equal(reader.read_range(name, held), data), name
                assert not name.startswith("optim.exp_avg") or not torch.equal(local[name][1], data), name  # step 2 changed it
        writer.confirm(1.0, 1)
        writer.offer(3, {})
        writer.wait()
        assert store.steps() == [1, 3] and len(lines) == 1
        assert {dtype: b.data_ptr() for dtype, b in writer.host_buffers.buffers.items()} == reserved
    finally:
        dist.destroy_process_group()


def test_a_save_that_waits_for_the_previous_async_save_says_how_long_it_stalled(tmp_path, monkeypatch):
    """The previous save's writing is held for 0.3 s: the next save's call waits for it, counts
        the wait in the stall and says so in one line; each save holds the model and AdamW state of its
    own step, though a training step ran between them and changed every tensor."""
    from fsdpkit.checkpoint.live import checkpointer as live

    release = threading.Event()
    real_run_save = live.run_save

    def held_run_save(job, ranks, timings):
        release.wait(10)
        return real_run_save(job, ranks, timings)

    monkeypatch.setattr(live, "run_save", held_run_save)
    lines: list[str] = []
    monkeypatch.setattr(live.log, "warn", lines.append)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = fsdpkit.shard(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        saver = fsdpkit.Checkpointer(model, optimizer, async_save=True)
        expected = {}
        _step(model, optimizer, 1)
        expected[1] = _local_state(model, optimizer)
        saver.save(tmp_path, step=1)
        _step(model, optimizer, 2)
        expected[2] = _local_state(model, optimizer)
        threading.Timer(0.3, release.set).start()
        saver.save(tmp_path, step=2)
        saver.wait()
        (line,) = lines
        waited = float(line.split("stalled training ")[1].split(" s")[0])
        assert line == f"save of step 2 stalled training {waited:.2f} s: the async save of step 1 was still being written"
        assert 0.25 <= waited <= saver.stall_seconds + 0.005  # the line rounds to hundredths
        assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000001", "step-00000002"]
        for step, state in expected.items():
            with CheckpointReader(tmp_path / f"step-{step:08d}", validate_all=False) as reader:
                for name, (held, data) in state.items():
                    assert torch.equal(reader.read_range(name, held), data), (step, name)
        assert not any(torch.equal(expected[1][name][1], expected[2][name][1]) for name in expected[1])  # step 2 changed each
    finally:
        release.set()
        dist.destroy_process_group()
