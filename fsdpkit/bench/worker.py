"""The process that runs inside each rank: time every collective at every size, check results.

Per size, as nccl-tests does: the out-of-place run, then the in-place run. Each run is
`warmup` untimed calls, a barrier, then `iters` calls between two host timestamps (with a
device synchronize on CUDA); this rank's time is their mean. The launching process gets,
from every rank, the maximum of those means over all ranks, and with --check the number of
wrong elements summed over all ranks (--check N: N more runs on fresh inputs, each compared
element by element against the expected values).

Test hooks: with FSDPKIT_BENCH_CORRUPT_RANK=R in the environment, rank R overwrites the first
element of every checked result with -1 (no correct value is negative) before counting; with
FSDPKIT_BENCH_FAIL_RANK=R, rank R raises before joining the process group.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from .. import log
from .busbw import MODES, BenchSize
from .collectives import PreparedCollective, RankContext, prepare, supports_mode
from .options import torch_dtype
from .stream import append_row

CORRUPT_RANK_ENV = "FSDPKIT_BENCH_CORRUPT_RANK"
FAIL_RANK_ENV = "FSDPKIT_BENCH_FAIL_RANK"


@dataclass(frozen=True)
class BenchEntry:
    collective: str
    variant: str
    sizes: tuple[BenchSize, ...]
    nccl_tests: str = ""


@dataclass(frozen=True)
class BenchSpec:
    entries: tuple[BenchEntry, ...]
    backend: str
    dtype: str
    iters: int
    warmup: int
    check: int  # result checks per size and mode
    op: str = "sum"
    timeout: float = 300.0  # seconds any collective may wait (--timeout)
    rows_path: str | None = None  # global rank 0 appends each size's row here as it is measured (stream.py)


@dataclass(frozen=True)
class Measurement:
    """One size, one mode, combined over ranks."""

    seconds: float  # max over ranks of each rank's mean time per call
    wrong: int | None  # wrong elements summed over ranks; None without --check


SizeMeasurements = dict[str, Measurement | None]  # mode -> measurement (None: the mode does not exist)


@record
def bench_worker(spec: BenchSpec) -> list[list[SizeMeasurements]]:
    """Entry point for fsdpkit.dist.launch: returns, per entry and size, the combined measurements."""
    log.setup()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if os.environ.get(FAIL_RANK_ENV, "") == os.environ.get("RANK"):
        raise RuntimeError(f"injected failure ({FAIL_RANK_ENV}={os.environ['RANK']})")
    device = start_process_group(spec.backend, local_rank, timeout=spec.timeout)
    group = dist.group.WORLD
    try:
        where = RankContext(
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            dtype=torch_dtype(spec.dtype),
            device=device,
            group=group,
        )
        corrupt = os.environ.get(CORRUPT_RANK_ENV, "") == str(dist.get_rank())
        return _measure_spec(spec, where, corrupt=corrupt)
    finally:
        dist.destroy_process_group()


def _measure_spec(spec: BenchSpec, where: RankContext, *, corrupt: bool) -> list[list[SizeMeasurements]]:
    from tqdm import tqdm

    total = sum(len(entry.sizes) for entry in spec.entries)
    rows_path = spec.rows_path if where.rank == 0 else None
    # The rows shown as they come are the progress; without them (--json), a bar on a terminal.
    hidden = where.rank != 0 or spec.rows_path is not None
    progress = tqdm(total=total, desc="bench", unit="size", file=sys.stderr, disable=True if hidden else None, leave=False)
    results = []
    with progress:
        for index, entry in enumerate(spec.entries):
            rows = []
            for size in entry.sizes:
                progress.set_postfix_str(f"{entry.collective} {size.size_bytes} B")
                rows.append(measure_size(entry, size, spec, where, corrupt=corrupt))
                if rows_path is not None:
                    row = {mode: None if m is None else (m.seconds, m.wrong) for mode, m in rows[-1].items()}
                    append_row(rows_path, index, len(rows) - 1, row)
                progress.update(1)
            results.append(rows)
    return results


def measure_size(entry: BenchEntry, size: BenchSize, spec: BenchSpec, where: RankContext, *, corrupt: bool = False) -> SizeMeasurements:
    """Every mode of one collective at one size, combined over the ranks of `where.group`."""
    modes = [mode for mode in MODES if supports_mode(entry.collective, mode)]
    seconds = []
    wrong = []
    for mode in modes:
        prepared = prepare(entry.collective, entry.variant, mode, size.count, where, op=spec.op)
        seconds.append(_time_calls(prepared, spec, where))
        wrong.append(sum(_count_wrong(prepared, where, corrupt=corrupt) for _ in range(spec.check)))
        del prepared
    # Two tiny collectives combine the ranks: the slowest rank's mean, the sum of wrong elements.
    slowest = torch.tensor(seconds, dtype=torch.float64, device=where.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=where.group)
    wrong_total = torch.tensor(wrong, dtype=torch.int64, device=where.device)
    dist.all_reduce(wrong_total, op=dist.ReduceOp.SUM, group=where.group)
    measured = {
        mode: Measurement(seconds=float(slowest[i]), wrong=int(wrong_total[i]) if spec.check else None) for i, mode in enumerate(modes)
    }
    return {mode: measured.get(mode) for mode in MODES}


def _time_calls(prepared: PreparedCollective, spec: BenchSpec, where: RankContext) -> float:
    for _ in range(spec.warmup):
        prepared.run()
    _synchronize(where)
    _barrier(where)
    start = time.perf_counter()
    for _ in range(spec.iters):
        prepared.run()
    _synchronize(where)
    return (time.perf_counter() - start) / spec.iters


def _count_wrong(prepared: PreparedCollective, where: RankContext, *, corrupt: bool) -> int:
    from .patterns import count_wrong

    prepared.reset()
    _barrier(where)
    prepared.run()
    _synchronize(where)
    result = prepared.result()
    if corrupt:
        result = result.clone()
        result.view(-1)[0] = -1
    return count_wrong(result, prepared.expected(), rtol=prepared.rtol)


def _synchronize(where: RankContext) -> None:
    if where.device.type == "cuda":
        torch.cuda.synchronize(where.device)


def _barrier(where: RankContext) -> None:
    if where.device.type == "cuda":
        dist.barrier(group=where.group, device_ids=[where.device.index])
    else:
        dist.barrier(group=where.group)


def start_process_group(backend: str, local_rank: int, *, timeout: float) -> torch.device:
    """Init the default group for `backend`; return the device its tensors live on."""
    limit = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=limit)
        return device
    dist.init_process_group(backend, timeout=limit)
    return torch.device("cpu")
