"""`fsdpkit plan --calibrate OUT.toml`: a hardware profile of this machine, measured.

    memory    a large copy gives the memory bandwidth (the optimizer step, the operators
              that are not matrix products)
    compute   a large matrix product gives the peak; the engine's forward and backward of
              the model on one rank, at two micro-batch sizes, less the memory-bound time,
              gives the achieved fraction of it (efficiency) and the fixed cost per unit and
              pass (the least-squares line of time against FLOPs)
    network   `fsdpkit bench` of the engine's all-gather and reduce-scatter on `ranks` local
              processes; the least-squares line of time against size gives the latency per
              ring step (intercept) and the bus bandwidth (slope)

Numbers are medians of repeated timings; a loaded machine gives a slower profile.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .hardware import Hardware
from .memory_plan import PlanRequest

REPEATS = 5


def _median_seconds(run: Callable[[], object], repeats: int = REPEATS) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return mean_y - slope * mean_x, slope


def peak_flops() -> float:
    size = 1024
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / _median_seconds(lambda: a @ b)


def memory_bandwidth() -> float:
    source = torch.empty(32 * 1024**2 // 4)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _median_seconds(lambda: target.copy_(source))


def compute_line(request: PlanRequest, batches: tuple[int, int], bytes_per_second: float) -> tuple[float, float, int]:
    """(intercept s, s per FLOP, units) of the engine's forward+backward on one in-process rank,
    less the time its other operators take to move their bytes at `bytes_per_second`."""
    import torch.distributed as dist

    from .engine.api import shard
    from .engine.plan import plan_units
    from .flops import unit_work
    from .models.source import resolve
    from .train.model_setup import wrap_policy

    source = resolve(request.model)
    seq_len = request.config.data.seq_len
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = source.build(device="cpu", seed=0)
        policy = wrap_policy(request.config.model, source, model)
        meta = source.build(device="meta", seed=0)
        plans = plan_units(meta, policy)
        work = unit_work(source, plans, 1, seq_len)
        per_sequence = sum(w.forward_flops + w.backward_flops for w in work)
        moved = sum(w.forward_bytes + w.backward_bytes for w in work) / bytes_per_second
        model = shard(model, request.sharding, wrap=policy, device="cpu")
        flops: list[float] = []
        seconds: list[float] = []
        for batch in batches:
            tokens = torch.randint(0, 256, (batch, seq_len + 1))

            flops.append(float(per_sequence * batch))
            seconds.append(_median_seconds(functools.partial(_forward_backward, source, model, tokens)) - moved * batch)
    finally:
        dist.destroy_process_group()
    intercept, slope = _line(flops, seconds)
    return max(intercept, 0.0), slope, len(plans)


def _forward_backward(source, model, tokens: torch.Tensor) -> None:
    logits = source.logits(model, tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()


def network_line(ranks: int) -> tuple[float, float]:
    """(latency per ring step s, bus bandwidth bytes/s) of the engine's collectives on `ranks` local processes."""
    from .bench.options import BenchOptions
    from .bench.runner import run_bench
    from .launch import LaunchOptions

    sizes, times = [], []
    for collective, variant in (("allgather", "flat"), ("reducescatter", "fsdpkit")):
        options = BenchOptions(
            collectives=(collective,), variant=variant, min_bytes=4096, max_bytes=4 * 1024**2, factor=4, iters=10, warmup=2
        )
        for result in run_bench(options, launch_options=LaunchOptions(nproc_per_node=ranks)).results:
            for row in result.rows:
                for _, mode in row.modes():
                    if mode is not None:
                        sizes.append(row.size_bytes * (ranks - 1) / ranks)
                        times.append(mode.time_us * 1e-6)
    intercept, slope = _line(sizes, times)
    return max(intercept, 0.0) / (ranks - 1), 1.0 / slope if slope > 0 else float("inf")


def calibrate(request: PlanRequest, *, ranks: int = 2, batches: tuple[int, int] = (1, 4)) -> Hardware:
    """One thread per rank, as fsdpkit launches CPU ranks (OMP_NUM_THREADS=1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = peak_flops()
        bandwidth_memory = memory_bandwidth()
        intercept, seconds_per_flop, units = compute_line(request, batches, bandwidth_memory)
    finally:
        torch.set_num_threads(threads)
    latency, bandwidth = network_line(ranks)
    bandwidth_gbs = bandwidth / 1e9
    return Hardware(
        name="calibrated",
        source=f"measured by fsdpkit plan --calibrate on this machine ({request.model}, {ranks} gloo ranks)",
        peak_tflops={"fp32": peak / 1e12},
        efficiency=min(1.0, 1.0 / seconds_per_flop / peak) if seconds_per_flop > 0 else 1.0,
        unit_overhead_s=intercept / (2 * units),
        memory_gb=_memory_gb(),
        memory_bw_gbs=bandwidth_memory / 1e9,
        ranks_per_node=1024,
        intra_bw_gbs=bandwidth_gbs,
        intra_latency_s=latency,
        inter_bw_gbs=bandwidth_gbs,
        inter_latency_s=latency,
        host_bw_gbs=bandwidth_memory / 1e9,
        overlap=False,
        compute_slots=os.cpu_count() or 1,
    )


def _memory_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
