"""Does `fsdpkit bench` add time of its own? Its harness against a plain torch.distributed loop.

In one process tree (one launch), every rank times each collective at each size twice: with
fsdpkit's harness (fsdpkit.bench.worker.measure_size, the code behind `fsdpkit bench`), and
with the plainest loop over the same torch.distributed call on same-sized tensors
(warmup, barrier, perf_counter around `iters` calls, max over ranks). The two alternate
(A B, then B A) for `--repeats` rounds; each side's median is compared, and each side's
minimum (the least disturbed run: on a shared CPU, run-to-run noise reaches 2x). A ratio
near 1.0 means the harness reports what torch.distributed itself takes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_overhead.py --nproc-per-node 2 \\
        --min-bytes 64K --max-bytes 16M --factor 4 --iters 20 --repeats 3

Add --backend nccl on a GPU machine (one process per GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from fsdpkit.bench.busbw import bench_sizes, size_sweep
from fsdpkit.bench.collectives import RankContext
from fsdpkit.bench.worker import BenchEntry, BenchSpec, measure_size, start_process_group
from fsdpkit.dist.comm import all_gather_flat, reduce_scatter_flat
from fsdpkit.dist.launch import LaunchOptions, launch
from fsdpkit.sizes import parse_size

# The mode each plain loop matches: out of place where torch has it, else in place.
COMPARED_MODE = {
    "allgather": "out_of_place",
    "reducescatter": "out_of_place",
    "alltoall": "out_of_place",
    "allreduce": "in_place",
    "broadcast": "in_place",
}


def plain_loop_seconds(collective: str, count: int, *, world_size: int, iters: int, warmup: int, device, dtype) -> float:
    """The simplest timing of one collective: what a person would write by hand."""
    n = world_size
    if collective == "allgather":
        shard, full = torch.ones(count, dtype=dtype, device=device), torch.empty(count * n, dtype=dtype, device=device)
        call = lambda: all_gather_flat(full, shard)  # noqa: E731
    elif collective == "reducescatter":
        shard, full = torch.empty(count, dtype=dtype, device=device), torch.ones(count * n, dtype=dtype, device=device)
        call = lambda: reduce_scatter_flat(shard, full)  # noqa: E731
    elif collective == "allreduce":
        buffer = torch.ones(count, dtype=dtype, device=device)
        call = lambda: dist.all_reduce(buffer)  # noqa: E731
    elif collective == "broadcast":
        buffer = torch.ones(count, dtype=dtype, device=device)
        call = lambda: dist.broadcast(buffer, src=0)  # noqa: E731
    else:
        send, receive = torch.ones(count * n, dtype=dtype, device=device), torch.empty(count * n, dtype=dtype, device=device)
        call = lambda: dist.all_to_all_single(receive, send)  # noqa: E731
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0])


@record
def overhead_worker(spec: BenchSpec, repeats: int) -> list[tuple[str, int, list[float], list[float]]]:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = start_process_group(spec.backend, local_rank, timeout=spec.timeout)
    try:
        where = RankContext(
            rank=dist.get_rank(), world_size=dist.get_world_size(), dtype=getattr(torch, spec.dtype), device=device, group=dist.group.WORLD
        )
        samples = []
        for entry in spec.entries:
            mode = COMPARED_MODE[entry.collective]
            for size in entry.sizes:
                harness, plain = [], []
                for repeat in range(repeats):
                    for harness_turn in (True, False) if repeat % 2 == 0 else (False, True):
                        if harness_turn:
                            harness.append(measure_size(entry, size, spec, where)[mode].seconds)
                        else:
                            plain.append(
                                plain_loop_seconds(
                                    entry.collective,
                                    size.count,
                                    world_size=where.world_size,
                                    iters=spec.iters,
                                    warmup=spec.warmup,
                                    device=device,
                                    dtype=where.dtype,
                                )
                            )
                samples.append((entry.collective, size.size_bytes, harness, plain))
        return samples
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--collectives", default="allgather,reducescatter,allreduce,broadcast,alltoall")
    parser.add_argument("--min-bytes", default="64K")
    parser.add_argument("--max-bytes", default="16M")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    world_size = args.nproc_per_node
    element_size = torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    requested = size_sweep(parse_size(args.min_bytes), parse_size(args.max_bytes), args.factor)
    entries = tuple(
        BenchEntry(
            collective=name,
            variant="flat" if name == "allgather" else "",
            sizes=tuple(bench_sizes(name, requested, world_size, element_size)),
        )
        for name in args.collectives.split(",")
    )
    spec = BenchSpec(entries=entries, backend=args.backend, dtype=args.dtype, iters=args.iters, warmup=args.warmup, check=False)
    started = time.perf_counter()
    returned = launch(overhead_worker, spec, args.repeats, options=LaunchOptions(nproc_per_node=world_size))
    samples = returned[min(returned)]

    print(
        f"# fsdpkit bench harness vs plain torch.distributed loop: {world_size} ranks, {args.backend}, {args.dtype}, "
        f"iters {args.iters}, warmup {args.warmup}, repeats {args.repeats} (median of each side)"
    )
    print(
        f"# {'collective':<14} {'size(B)':>10} {'fsdpkit(us)':>12} {'plain(us)':>12} {'ratio':>7}"
        f" {'min fsdpkit':>12} {'min plain':>10} {'ratio':>7}"
    )
    median_ratios: dict[str, list[float]] = {}
    min_ratios: dict[str, list[float]] = {}
    for collective, size_bytes, harness, plain in samples:
        harness_us, plain_us = statistics.median(harness) * 1e6, statistics.median(plain) * 1e6
        best_harness_us, best_plain_us = min(harness) * 1e6, min(plain) * 1e6
        median_ratios.setdefault(collective, []).append(harness_us / plain_us)
        min_ratios.setdefault(collective, []).append(best_harness_us / best_plain_us)
        print(
            f"  {collective:<14} {size_bytes:>10} {harness_us:>12.1f} {plain_us:>12.1f} {harness_us / plain_us:>7.3f}"
            f" {best_harness_us:>12.1f} {best_plain_us:>10.1f} {best_harness_us / best_plain_us:>7.3f}"
        )
    for collective in median_ratios:
        print(
            f"# {collective:<14} geometric mean ratio: medians {_geometric_mean(median_ratios[collective]):.3f}, "
            f"minimums {_geometric_mean(min_ratios[collective]):.3f}"
        )
    every_median = [ratio for ratios in median_ratios.values() for ratio in ratios]
    every_min = [ratio for ratios in min_ratios.values() for ratio in ratios]
    print(
        f"# overall geometric mean ratio fsdpkit/plain: medians {_geometric_mean(every_median):.3f}, "
        f"minimums {_geometric_mean(every_min):.3f}; wall {time.perf_counter() - started:.1f} s"
    )


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))


if __name__ == "__main__":
    main()
