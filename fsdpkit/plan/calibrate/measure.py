"""Timing for calibration: a large matrix product, copy and elementwise sum (the peak, the
memory bandwidth and the share of it elementwise kernels reach), the engine's training step
of a model on one rank, `fsdpkit bench`'s collectives, and the engine's steps on several
local processes (calibrate.runs' placements).

Numbers are medians of repeated timings, each going on for at least the seconds asked for."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UsageError
from ...models.recipe import Optimizer
from ..flops import unit_work
from ..kernels import OptimizerKernel, loss_bytes, optimizer_bytes_per_element, reduce_cast_bytes
from ..meta import build_meta_model
from ..predict import ModelCosts, predict
from ..profile import Hardware
from ..request import PlanRequest
from .runs import TimedStep

REPEATS = 5  # at least; then rounds go on until the time asked for has passed

NETWORK_RUNS = 3  # bench launches the bus bandwidth is the median of, at least

WARMUP_STEPS = 3

STEPS = 8  # at least


@dataclass(frozen=True)
class MemoryRates:
    """Bytes per second of a large copy (the memory bandwidth) and of a large elementwise sum."""

    copy: float
    elementwise: float

    @property
    def efficiency(self) -> float:
        """The share of the bandwidth elementwise kernels reach (Hardware.memory_efficiency)."""
        return min(1.0, self.elementwise / self.copy)


class Probes:
    """A large matrix product (the peak), a large copy (the memory bandwidth) and a large
    elementwise sum (what bandwidth-bound kernels reach of it)."""

    SIZE = 1024
    VECTOR = 128 * 1024**2 // 4  # elements: well beyond the caches

    def __init__(self) -> None:
        self.a, self.b = torch.randn(self.SIZE, self.SIZE), torch.randn(self.SIZE, self.SIZE)
        self.source, self.other, self.target = (torch.empty(self.VECTOR) for _ in range(3))

    def time(self) -> tuple[float, float, float]:
        """Seconds of (the product, the copy, the sum)."""
        start = time.perf_counter()
        self.a @ self.b
        product = time.perf_counter()
        self.target.copy_(self.source)
        copy = time.perf_counter()
        torch.add(self.source, self.other, out=self.target)
        return product - start, copy - product, time.perf_counter() - copy

    def rates(self, timings: list[tuple[float, float, float]]) -> tuple[float, MemoryRates]:
        """(FLOP/s, memory rates) from the medians: the copy reads and writes a vector, the sum reads two."""
        product, copy, add = (statistics.median(t[i] for t in timings) for i in (0, 1, 2))
        vector = self.VECTOR * 4
        return 2 * self.SIZE**3 / product, MemoryRates(2 * vector / copy, 3 * vector / add)


@dataclass(frozen=True)
class StepSample:
    """One model's measured step on one in-process rank, with what the step-time model charges."""

    flops: float  # forward + backward
    memory_s: float  # the other operators', the loss's and the gradient copies' bytes at the elementwise rate
    unit_passes: int  # wrapped modules x 2 (a forward and a backward each)
    param_bytes: float  # the unsharded parameters x 2 passes
    forward_backward_s: float
    tensors: int  # parameter tensors the optimizer steps over
    optimizer_memory_s: float  # the optimizer's kernels' bytes at the elementwise rate
    optimizer_s: float


class ModelRun:
    """One model sharded by the engine over `group` (default: every rank), with AdamW, and what the
    model charges per step on one rank."""

    def __init__(self, request: PlanRequest, spec: str, group: Any = None) -> None:
        from ...engine.api import shard

        # the calibration models measure one unit per block (their point is the cost per unit)
        sharding = request.sharding if spec == request.model else replace(request.sharding, bucket_bytes=0)
        meta = build_meta_model(spec, request, sharding.bucket_bytes)
        self.source, self.plans, self.seq_len = meta.source, meta.plans, request.seq_len  # the engine's units
        self.work = unit_work(meta.source, list(meta.plans), 1, self.seq_len)
        self.numel = sum(p.numel() for p in meta.model.parameters() if p.requires_grad)
        self.optimizer_bytes = self.numel * optimizer_bytes_per_element(Optimizer.ADAMW, OptimizerKernel.EAGER)  # the CPU AdamW below
        # one rank in fp32: no casts, the reductions' gradient copies
        self.copy_bytes = reduce_cast_bytes(self.numel, self.numel, master=4, compute=4, reduce=4, offload=False)
        self.logits = max(w.logits for w in self.work)
        torch.manual_seed(0)
        model = self.source.build(device="cpu", seed=0)
        self.model = shard(model, sharding, wrap=meta.policy, group=group, device="cpu")
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batch: int) -> tuple[float, float]:
        """Seconds of (forward + backward, optimizer step)."""
        tokens = torch.randint(0, 256, (batch, self.seq_len + 1))
        start = time.perf_counter()
        logits = self.source.logits(self.model, tokens[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return middle - start, time.perf_counter() - middle

    def sample(self, batch: int, timings: list[tuple[float, float]], memory: MemoryRates) -> StepSample:
        work, bytes_per_second = self.work, memory.elementwise
        moved = batch * sum(w.forward_bytes + w.backward_bytes for w in work) + self.copy_bytes
        return StepSample(
            flops=float(batch * sum(w.forward_flops + w.backward_flops for w in work)),
            memory_s=(moved + loss_bytes(batch * self.seq_len, self.logits, compute=4)) / bytes_per_second,
            unit_passes=2 * sum(len(plan.members) for plan in self.plans),
            param_bytes=2.0 * self.numel * 4,
            forward_backward_s=statistics.median(t[0] for t in timings),
            tensors=sum(param.requires_grad for plan in self.plans for param in plan.params),
            optimizer_memory_s=self.optimizer_bytes / bytes_per_second,
            optimizer_s=statistics.median(t[1] for t in timings),
        )


def measure_steps(
    request: PlanRequest, specs: Sequence[str], batches: tuple[int, ...], seconds: float
) -> tuple[float, MemoryRates, list[StepSample]]:
    """(peak FLOP/s, memory rates, samples): the matrix product, the copy, the sum and the engine's
    training step (forward, backward, AdamW) of each model at each batch on one rank take
    turns, so that load from other processes falls on all of them alike."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # as fsdpkit launches CPU ranks (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        probes = Probes()
        runs = [ModelRun(request, spec) for spec in specs]
        cases = [(run, batch) for run in runs for batch in batches]
        probed: list[tuple[float, float, float]] = []
        timings: list[list[tuple[float, float]]] = [[] for _ in cases]
        started = time.perf_counter()
        round_index = 0
        while round_index <= REPEATS or time.perf_counter() - started < seconds:
            probe = probes.time()
            timed = [run.step(batch) for run, batch in cases]
            if round_index:  # the first round warms up
                probed.append(probe)
                for case, timing in enumerate(timed):
                    timings[case].append(timing)
            round_index += 1
        peak, bandwidth = probes.rates(probed)
        return peak, bandwidth, [run.sample(batch, timing, bandwidth) for (run, batch), timing in zip(cases, timings, strict=True)]
    finally:
        dist.destroy_process_group()


def network_line(ranks: int, seconds: float) -> tuple[float, float]:
    """(latency per ring step s, bus bandwidth bytes/s) of the engine's collectives on `ranks` local
    processes: the medians over `fsdpkit bench` launches, NETWORK_RUNS at least and until
    `seconds` have passed. One launch's line swings: gloo over loopback here gave 0.42-3.4 GB/s
    from one launch to the next. A launch whose times do not grow with the bytes (a machine too
    busy to measure) gives no bandwidth and is left out, up to 2 x NETWORK_RUNS of them."""
    lines: list[tuple[float, float]] = []
    started, left_out = time.perf_counter(), 0
    while (len(lines) < NETWORK_RUNS or time.perf_counter() - started < seconds) and left_out < 2 * NETWORK_RUNS:
        line = _bench_line(ranks)
        if math.isfinite(line[1]):
            lines.append(line)
        else:
            left_out += 1
    if not lines:
        raise UsageError(
            f"calibrate: in {left_out} launches the collectives' time did not grow with their bytes (a busy machine); run it again"
        )
    return statistics.median(line[0] for line in lines), statistics.median(line[1] for line in lines)


def _bench_line(ranks: int) -> tuple[float, float]:
    """network_line's (latency, bandwidth) from one bench launch: the least-squares line of time
    against the bytes each rank moves, over the engine's all-gather and reduce-scatter."""
    from ...bench.options import BenchOptions
    from ...bench.runner import run_bench
    from ...dist.launch import LaunchOptions

    sizes, times = [], []
    for collective in ("allgather", "reducescatter"):
        options = BenchOptions(
            collectives=(collective,), variant="fsdpkit", min_bytes=4096, max_bytes=4 * 1024**2, factor=4, iters=10, warmup=2
        )
        for result in run_bench(options, launch_options=LaunchOptions(nproc_per_node=ranks)).results:
            for row in result.rows:
                for _, mode in row.modes():
                    if mode is not None:
                        sizes.append(row.size_bytes * (ranks - 1) / ranks)
                        times.append(mode.time_us * 1e-6)
    intercept, slope = _line(sizes, times)
    return max(intercept, 0.0) / (ranks - 1), 1.0 / slope if slope > 0 else float("inf")


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


@dataclass(frozen=True)
class Measured:
    """A step timed on `run`'s ranks, and the model's costs of it."""

    run: PlanRequest
    measured_s: float

    def predicted(self, profile: Hardware, costs: ModelCosts) -> float:
        """The model's step on `profile` (its ranks sharing a node's cores as the profile says)."""
        return predict(self.run, profile, costs, per_node=self.run.world_size).time.step_time_s

    def alone(self, profile: Hardware, costs: ModelCosts) -> tuple[float, float]:
        """The model's (step, compute) with a core per rank."""
        time = predict(self.run, replace(profile, compute_slots=0), costs, per_node=self.run.world_size).time
        return time.step_time_s, time.compute_s


def measure(placements: Sequence[TimedStep], seconds: float) -> list[Measured]:
    """The engine's steps of `placements`, launched once on as many ranks as the largest takes
    (each on the first of them) and taken in turns, so that a drifting machine speed moves them
    alike; timed until they total at least `seconds` (and STEPS each)."""
    from ...dist.launch import LaunchOptions, launch

    ranks = max(placement.ranks for placement in placements)
    medians = launch(_measured_steps, list(placements), seconds, options=LaunchOptions(nproc_per_node=ranks))[0]
    return [Measured(placement.run, median) for placement, median in zip(placements, medians, strict=True)]


def on_first_ranks(placement: TimedStep) -> tuple[Any, ModelRun | None]:
    """(process group of its ranks, the engine's model of this rank's copy) of `placement` on the
    first ranks of the launch; the group is None where that is every rank, the model None on the
    other ranks. Every rank must call it, as new_group requires."""
    import torch.distributed as dist

    run, world, rank = placement.run, dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(placement.ranks))) if placement.ranks < world else None
    if placement.copies == 1:
        own = group
    else:
        copies = [dist.new_group(list(range(start, start + run.world_size))) for start in range(0, placement.ranks, run.world_size)]
        own = copies[rank // run.world_size] if rank < placement.ranks else None
    return group, ModelRun(run, run.model, group=own) if rank < placement.ranks else None


def _measured_steps(placements: list[TimedStep], seconds: float) -> list[float]:
    """One rank's part: for each placement, the median of the slowest rank's training step over at
    least STEPS rounds (after WARMUP_STEPS) and until the rounds total `seconds`."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        models = [on_first_ranks(placement)[1] for placement in placements]  # every rank makes every group, as new_group requires
        steps: list[list[float]] = [[] for _ in placements]
        index = 0
        while index < WARMUP_STEPS + STEPS or sum(map(sum, steps)) < seconds:  # the same on every rank: maxima over ranks
            for placement, model, times in zip(placements, models, steps, strict=True):
                dist.barrier()
                elapsed = torch.tensor([sum(model.step(placement.run.micro_batch)) if model is not None else 0.0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if index >= WARMUP_STEPS:
                    times.append(float(elapsed))
            index += 1
        return [statistics.median(times) for times in steps]
    finally:
        dist.destroy_process_group()
