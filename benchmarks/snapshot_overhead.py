"""What a snapshot written in the background costs the training thread, on CPU: a Python loop
that launches small torch ops (as a training loop launches kernels) counts its iterations per
second while the snapshot of a `--size-mb` model is written to shared memory, against the same
loop alone for as long; and the time the training thread spends in the snapshot call, against
one plain copy of the same bytes into a buffer.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_overhead.py --size-mb 2048 --repeat 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/snapshot_overhead.py --size-mb 256 --repeat 3

One process (a gloo group of one), the real `SnapshotWriter` writing into a store under
/dev/shm (removed afterwards), a model of 4096 x 4096 fp32 Linear layers sharded by fsdpkit
(its parameters only: no optimizer). Each round runs, in an order that alternates: the loop
alone; the loop while a snapshot is written (from when `offer` returns until the writer
thread ends: copy wait, prune, write, crc32, header); and the plain copy. Ratios per round,
reported as median and range over `--repeat` rounds; `--json` prints one document.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdpkit
from fsdpkit.checkpoint.memory.store import DEFAULT_ROOT, SnapshotStore
from fsdpkit.checkpoint.memory.writer import SnapshotWriter

WIDTH = 4096
LAYER_MB = WIDTH * WIDTH * 4 // 2**20
POLL_EVERY = 256  # loop iterations between looks at the writer thread


@dataclass(frozen=True)
class LoopRun:
    """A loop's iterations, its wall time, and of that the time it waited for a CPU (Linux's
    schedstat run delay: other processes' doing on a shared machine) and the time it was
    blocked (neither running nor waiting for a CPU: the loop never sleeps, so waiting for the GIL)."""

    iterations: int
    wall: float
    cpu_wait: float
    gil_wait: float

    @property
    def rate(self) -> float:
        return self.iterations / self.wall

    @property
    def rate_on_own_core(self) -> float:
        """Iterations per second of the time it had a CPU or wanted the GIL."""
        return self.iterations / (self.wall - self.cpu_wait)


def _run_delay() -> float:
    """Seconds this thread has waited on a run queue (0 where schedstat is not there)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def python_loop(until) -> LoopRun:
    """A loop of small torch ops until `until()`."""
    x = torch.ones(16)
    count = 0
    started, cpu_started, delay_started = time.perf_counter(), time.thread_time(), _run_delay()
    while True:
        for _ in range(POLL_EVERY):
            x = x * 1.0001 + 0.0001
        count += POLL_EVERY
        if until():
            wall = time.perf_counter() - started
            cpu, delay = time.thread_time() - cpu_started, _run_delay() - delay_started
            return LoopRun(count, wall, delay, max(0.0, wall - cpu - delay))


def loop_for(seconds: float) -> LoopRun:
    end = time.perf_counter() + seconds
    return python_loop(lambda: time.perf_counter() >= end)


def loop_while_writing(writer: SnapshotWriter, step: int) -> tuple[LoopRun, float]:
    """(the loop while the snapshot is written, training-thread seconds in `offer`)."""
    started = time.perf_counter()
    writer.offer(step, {})
    blocked = time.perf_counter() - started
    thread = writer.thread
    assert thread is not None, "the snapshot was not taken"
    loop = python_loop(lambda: not thread.is_alive())
    writer.wait()
    writer.confirm(1.0, 1)
    return loop, blocked


def plain_copy_seconds(model: nn.Module, target: torch.Tensor) -> float:
    """One copy of every parameter's bytes into `target` (allocated and touched beforehand)."""
    started = time.perf_counter()
    at = 0
    with torch.no_grad():
        for param in model.parameters():
            flat = param.detach().reshape(-1)
            target[at : at + flat.numel()].copy_(flat)
            at += flat.numel()
    return time.perf_counter() - started


def run(args: argparse.Namespace) -> dict:
    layers = max(1, args.size_mb // LAYER_MB)
    model = fsdpkit.shard(nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))))
    numel = sum(p.numel() for p in model.parameters())
    target = torch.zeros(numel)
    with tempfile.TemporaryDirectory(prefix="snapshot-overhead-", dir=DEFAULT_ROOT) as root:
        store = SnapshotStore.create(root, run_id="snapshot-overhead", node_rank=0)
        writer = SnapshotWriter(store, model, None, peers=None, warn=print)
        rounds: list[dict[str, float]] = []
        for index in range(args.repeat):
            copy = plain_copy_seconds(model, target)
            if index % 2:  # alone first, for as long as the last write took
                alone = loop_for(rounds[-1]["write_s"])
                writing, blocked = loop_while_writing(writer, index + 1)
            else:
                writing, blocked = loop_while_writing(writer, index + 1)
                alone = loop_for(writing.wall)
            rounds.append(
                {
                    "loop_ratio": writing.rate / alone.rate,
                    "loop_ratio_own_core": writing.rate_on_own_core / alone.rate_on_own_core,
                    "gil_wait_share": writing.gil_wait / writing.wall,
                    "cpu_wait_share": writing.cpu_wait / writing.wall,
                    "cpu_wait_share_alone": alone.cpu_wait / alone.wall,
                    "blocked_over_copy": blocked / copy,
                    "blocked_s": blocked,
                    "copy_s": copy,
                    "write_s": writing.wall,
                }
            )
            print(
                f"round {index + 1}/{args.repeat}: " + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items()), file=sys.stderr, flush=True
            )
    summary = {"bytes": numel * 4, "rounds": rounds}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048, help="model size in MiB (a multiple of 64)")
    parser.add_argument("--repeat", type=int, default=5, help="rounds")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"snapshot of {result['bytes'] / 2**30:.2f} GiB, {args.repeat} rounds: median [min..max]")
    for key, label in (
        ("loop_ratio", "Python loop while writing / alone"),
        ("loop_ratio_own_core", "the same, leaving out its waits for a CPU"),
        ("gil_wait_share", "share of the writing time the loop waited for the GIL"),
        ("cpu_wait_share", "share of it the loop waited for a CPU"),
        ("cpu_wait_share_alone", "the same, alone"),
        ("blocked_over_copy", "training thread in the snapshot / one plain copy"),
        ("blocked_s", "training thread in the snapshot, s"),
        ("copy_s", "one plain copy, s"),
        ("write_s", "background write, s"),
    ):
        entry = result[key]
        print(f"  {label:<52} {entry['median']:8.3f} [{entry['min']:.3f}..{entry['max']:.3f}]")


if __name__ == "__main__":
    main()
