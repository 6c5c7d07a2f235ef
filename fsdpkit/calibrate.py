"""`fsdpkit plan --calibrate OUT.toml`: a hardware profile of this machine, measured.

    memory    a large copy gives the memory bandwidth (the optimizer step, the operators
              that are not matrix products)
    compute   a large matrix product gives the peak; the engine's training step on one
              rank of several models (`--model` and two of many narrow and few wide units)
              at two micro-batch sizes, taking turns, gives by non-negative least squares
              the achieved fraction of the peak (efficiency), the cost per unit and pass
              and per parameter byte and pass, and the optimizer's cost per tensor and its
              traffic over the minimum. The cost per operator is not fitted (0): these
              models' operators grow with their units, so the two cannot be told apart
    network   `fsdpkit bench` of the engine's all-gather and reduce-scatter on `ranks` local
              processes: the least-squares line of time against size gives the bus
              bandwidth of the collectives alone (slope; the median over several launches);
              `--model`'s step on one rank alone and on a rank per core at once gives how
              much slower a rank computes while the others keep every core busy; the
              engine's steps of a model of many units on 2 processes under full and grad-op,
              of `--model` on 2, and of both on more, give what a collective costs beyond
              its bytes, what a reduction costs beyond an all-gather, the bus bandwidth the
              steps get, how much of the latency recurs per ring step, and how much slower
              still a rank computes where ranks outnumber cores (fsdpkit.calibrate_steps)

Numbers are medians of repeated timings, each going on for at least `--calibrate-seconds`:
a shared machine's speed can drift by 15% within seconds (a virtual machine's neighbours), so
a longer calibration lands nearer its average. A loaded machine gives a slower profile.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from .calibrate_steps import Placement, all_cores_runs, all_cores_slowdown, fit_collectives, link_runs, measure, more_ranks_runs
from .hardware import CALIBRATE_SECONDS, Hardware
from .memory_plan import PlanRequest

REPEATS = 5  # at least; then rounds go on until the time asked for has passed
NETWORK_RUNS = 3  # bench launches the bus bandwidth is the median of, at least


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


class Probes:
    """A large matrix product (the peak) and a large copy (the memory bandwidth)."""

    SIZE = 1024

    def __init__(self) -> None:
        self.a, self.b = torch.randn(self.SIZE, self.SIZE), torch.randn(self.SIZE, self.SIZE)
        self.source = torch.empty(256 * 1024**2 // 4)  # well beyond the caches
        self.target = torch.empty_like(self.source)

    def time(self) -> tuple[float, float]:
        """Seconds of (the product, the copy)."""
        start = time.perf_counter()
        self.a @ self.b
        middle = time.perf_counter()
        self.target.copy_(self.source)
        return middle - start, time.perf_counter() - middle

    def rates(self, timings: list[tuple[float, float]]) -> tuple[float, float]:
        """(FLOP/s, bytes/s) from the medians."""
        product, copy = (statistics.median(t[i] for t in timings) for i in (0, 1))
        return 2 * self.SIZE**3 / product, 2 * self.source.numel() * 4 / copy


def many_narrow_units():
    """A calibration model: 16 blocks of 96 wide (the cost per unit and per tensor shows)."""
    from .models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=16, n_head=2, n_embd=96))


def few_wide_units():
    """A calibration model: 2 blocks of 512 wide (the cost per parameter byte shows)."""
    from .models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=512))


CALIBRATION_MODELS = ("fsdpkit.calibrate:many_narrow_units", "fsdpkit.calibrate:few_wide_units")
CALIBRATION_BATCHES = (1, 4)  # sequences per step: each model at both


@dataclass(frozen=True)
class StepSample:
    """One model's measured step on one in-process rank, with what the step-time model charges."""

    flops: float  # forward + backward
    memory_s: float  # the other operators' bytes at the memory bandwidth
    unit_passes: int  # wrapped modules x 2 (a forward and a backward each)
    param_bytes: float  # the unsharded parameters x 2 passes
    forward_backward_s: float
    tensors: int  # parameter tensors the optimizer steps over
    optimizer_memory_s: float  # the optimizer's minimal bytes at the memory bandwidth
    optimizer_s: float


@dataclass(frozen=True)
class ComputeTerms:
    seconds_per_flop: float
    unit_overhead_s: float
    seconds_per_param_byte: float
    optimizer_tensor_s: float
    optimizer_passes: float


def fit_nonnegative(rows: Sequence[Sequence[float]], ys: Sequence[float], *, scales: Sequence[float] | None = None) -> list[float]:
    """Least-squares coefficients of ys against the columns of rows, none negative: a column
    whose coefficient comes out negative is dropped (coefficient 0) and the rest refitted.
    With `scales`, each row and its y count divided by its scale."""
    if scales is not None:
        rows = [[value / scale for value in row] for row, scale in zip(rows, scales, strict=True)]
        ys = [y / scale for y, scale in zip(ys, scales, strict=True)]
    active = list(range(len(rows[0])))
    while active:
        a = torch.tensor([[row[j] for j in active] for row in rows], dtype=torch.float64)
        scale = a.abs().amax(dim=0).clamp(min=1e-300)
        b = torch.tensor(list(ys), dtype=torch.float64).unsqueeze(1)
        solution = (torch.linalg.lstsq(a / scale, b, driver="gelsd").solution.squeeze(1) / scale).tolist()
        if min(solution) >= 0:
            coefficients = [0.0] * len(rows[0])
            for j, value in zip(active, solution, strict=True):
                coefficients[j] = value
            return coefficients
        active.pop(solution.index(min(solution)))
    return [0.0] * len(rows[0])


def compute_terms(samples: Sequence[StepSample]) -> ComputeTerms:
    """The compute terms of the profile, fitted over every sample (several models and batch
    sizes) with the least squared error relative to each measured time, so that a short step
    counts as much as a long one."""
    per_flop, per_unit, per_byte = fit_nonnegative(
        [(s.flops, s.unit_passes, s.param_bytes) for s in samples],
        [s.forward_backward_s - s.memory_s for s in samples],
        scales=[s.forward_backward_s for s in samples],
    )
    per_tensor, extra_passes = fit_nonnegative(
        [(s.tensors, s.optimizer_memory_s) for s in samples],
        [s.optimizer_s - s.optimizer_memory_s for s in samples],
        scales=[s.optimizer_s for s in samples],
    )
    return ComputeTerms(per_flop, per_unit, per_byte, per_tensor, 1.0 + extra_passes)


def measure_steps(
    request: PlanRequest, specs: Sequence[str], batches: tuple[int, ...], seconds: float
) -> tuple[float, float, list[StepSample]]:
    """(peak FLOP/s, memory bytes/s, samples): the matrix product, the copy and the engine's
    training step (forward, backward, AdamW) of each model at each batch on one rank take
    turns, so that load from other processes falls on all of them alike."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # as fsdpkit launches CPU ranks (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        probes = Probes()
        runs = [ModelRun(request, spec) for spec in specs]
        cases = [(run, batch) for run in runs for batch in batches]
        probed: list[tuple[float, float]] = []
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


class ModelRun:
    """One model sharded by the engine over `group` (default: every rank), with AdamW, and what the
    model charges per step on one rank."""

    def __init__(self, request: PlanRequest, spec: str, group: Any = None) -> None:
        from .engine.api import shard
        from .engine.wrapping import bucket_units, plan_units
        from .flops import unit_work
        from .models.source import resolve
        from .time_plan import OPTIMIZER_TRAFFIC
        from .train.config import Optimizer
        from .train.model_setup import wrap_policy

        self.source = resolve(spec)
        self.seq_len = request.config.data.seq_len
        torch.manual_seed(0)
        model = self.source.build(device="cpu", seed=0)
        policy = wrap_policy(request.config.model, self.source, model)
        # the calibration models measure one unit per block (their point is the cost per unit)
        sharding = request.sharding if spec == request.model else replace(request.sharding, bucket_bytes=0)
        meta = self.source.build(device="meta", seed=0)
        self.plans = bucket_units(meta, plan_units(meta, policy), sharding.bucket_bytes)  # the engine's units
        self.work = unit_work(self.source, self.plans, 1, self.seq_len)
        self.numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.optimizer_bytes = self.numel * OPTIMIZER_TRAFFIC[Optimizer.ADAMW]
        self.model = shard(model, sharding, wrap=policy, group=group, device="cpu")
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

    def sample(self, batch: int, timings: list[tuple[float, float]], bytes_per_second: float) -> StepSample:
        work = self.work
        return StepSample(
            flops=float(batch * sum(w.forward_flops + w.backward_flops for w in work)),
            memory_s=batch * sum(w.forward_bytes + w.backward_bytes for w in work) / bytes_per_second,
            unit_passes=2 * sum(len(plan.members) for plan in self.plans),
            param_bytes=2.0 * self.numel * 4,
            forward_backward_s=statistics.median(t[0] for t in timings),
            tensors=sum(param.requires_grad for plan in self.plans for param in plan.params),
            optimizer_memory_s=self.optimizer_bytes / bytes_per_second,
            optimizer_s=statistics.median(t[1] for t in timings),
        )


def network_line(ranks: int, seconds: float) -> tuple[float, float]:
    """(latency per ring step s, bus bandwidth bytes/s) of the engine's collectives on `ranks` local
    processes: the medians over `fsdpkit bench` launches, NETWORK_RUNS at least and until
    `seconds` have passed. One launch's line swings: gloo over loopback here gave 0.42-3.4 GB/s
    from one launch to the next."""
    lines: list[tuple[float, float]] = []
    started = time.perf_counter()
    while len(lines) < NETWORK_RUNS or time.perf_counter() - started < seconds:
        lines.append(_bench_line(ranks))
    return statistics.median(line[0] for line in lines), statistics.median(line[1] for line in lines)


def _bench_line(ranks: int) -> tuple[float, float]:
    """network_line's (latency, bandwidth) from one bench launch: the least-squares line of time
    against the bytes each rank moves, over the engine's all-gather and reduce-scatter."""
    from .bench.options import BenchOptions
    from .bench.runner import run_bench
    from .dist.launch import LaunchOptions

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


def calibrate(request: PlanRequest, *, ranks: int = 2, seconds: float = CALIBRATE_SECONDS) -> Hardware:
    """The compute terms time training steps for at least `seconds`, the busy cores, latency and
    more-ranks terms (taken in turns) for twice that: the longer, the more of a machine's
    drifting speed is averaged over."""
    from tqdm import tqdm

    from .dist.launch import LaunchOptions, launch

    with tqdm(total=3, desc="calibrate", unit="part", file=sys.stderr, disable=None, leave=False) as progress:
        progress.set_postfix_str("compute, one rank")
        # in a launched rank, as training runs its steps
        one_rank = LaunchOptions(nproc_per_node=1)
        compute = launch(measure_steps, request, calibration_specs(request), CALIBRATION_BATCHES, seconds, options=one_rank)[0]
        progress.update()
        progress.set_postfix_str(f"bus bandwidth, {ranks} ranks")
        profile = measured_profile(request, compute, network_line(ranks, seconds), ranks)
        progress.update()
        all_cores, more = all_cores_runs(request, profile.compute_slots), more_ranks_runs(request, profile.compute_slots)
        progress.set_postfix_str(f"collectives on 2 ranks, compute on {all_cores[1].ranks} at once, steps on {more[0].world_size}")
        alone, at_once, full, gathers_fewer, bytes_heavy, *more_steps = measure(
            [*all_cores, *map(Placement, (*link_runs(request), *more))], 2 * seconds
        )
        progress.update()
    profile = replace(profile, all_cores_slowdown=all_cores_slowdown(alone.measured_s, at_once.measured_s))
    return fit_collectives(profile, [full, gathers_fewer, bytes_heavy], more_steps)


def calibration_specs(request: PlanRequest) -> tuple[str, ...]:
    """The models whose steps give the compute terms: `--model` and the calibration models."""
    return (request.model, *(spec for spec in CALIBRATION_MODELS if spec != request.model))


def measured_profile(
    request: PlanRequest, compute: tuple[float, float, list[StepSample]], network: tuple[float, float], ranks: int
) -> Hardware:
    """The profile from measure_steps' (peak, memory bandwidth, samples) and network_line's
    (latency, bus bandwidth) on `ranks` ranks, before fit_collectives."""
    peak, bandwidth_memory, samples = compute
    terms = compute_terms(samples)
    if terms.seconds_per_flop > 0:  # the models' matrix products may outrun the probe's
        peak = max(peak, 1.0 / terms.seconds_per_flop)
    latency, bandwidth = network
    return Hardware(
        name="calibrated",
        source=f"measured by fsdpkit plan --calibrate on this machine ({', '.join(calibration_specs(request))}; {ranks} gloo ranks)",
        peak_tflops={"fp32": peak / 1e12},
        efficiency=1.0 / terms.seconds_per_flop / peak if terms.seconds_per_flop > 0 else 1.0,
        unit_overhead_s=terms.unit_overhead_s,
        memory_gb=_memory_gb(),
        memory_bw_gbs=bandwidth_memory / 1e9,
        ranks_per_node=1024,
        intra_bw_gbs=bandwidth / 1e9,
        intra_latency_s=latency,
        inter_bw_gbs=bandwidth / 1e9,
        inter_latency_s=latency,
        host_bw_gbs=bandwidth_memory / 1e9,
        overlap=False,
        compute_slots=len(os.sched_getaffinity(0)),
        param_passes=terms.seconds_per_param_byte * bandwidth_memory,
        optimizer_tensor_s=terms.optimizer_tensor_s,
        optimizer_passes=terms.optimizer_passes,
    )


def _memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
