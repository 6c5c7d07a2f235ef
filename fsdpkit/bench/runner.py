"""Run a benchmark from the launching process: validate, choose sizes, launch ranks, combine.

    from fsdpkit.bench.options import BenchOptions
    from fsdpkit.bench.runner import run_bench
    from fsdpkit.dist.launch import LaunchOptions
    report = run_bench(BenchOptions(collectives=("allgather",), max_bytes=1 << 20),
                       launch_options=LaunchOptions(nproc_per_node=2))

Everything a user can get wrong is checked here, before a process starts (UsageError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ..dist.host import available_memory_bytes
from ..dist.launch import LaunchOptions, launch
from ..errors import DataCheckError, UsageError
from .busbw import bench_sizes, busbw_factor
from .notes import backend_note
from .options import REDUCING, BenchOptions, check_memory, element_size, resolve_backend
from .patterns import check_op_range
from .results import BenchReport, CollectiveResult, SizeResult, size_result
from .stream import RowCallback, TableStream, follow_rows
from .worker import BenchEntry, BenchSpec, bench_worker


def bench_spec(options: BenchOptions, *, launch_options: LaunchOptions) -> BenchSpec:
    """The sizes each collective runs at, rounded to valid counts for this world size."""
    local = launch_options.local_processes
    backend = resolve_backend(options.backend, nproc_per_node=local)
    world_size = launch_options.world_size
    reduces = any(collective in REDUCING for collective in options.collectives)
    if reduces and options.op == "avg" and backend != "nccl":
        raise UsageError("--op avg needs nccl: gloo has no average reduction")
    if reduces and options.check:
        check_op_range(options.op, world_size, options.dtype)
    if backend == "nccl":
        import torch

        check_memory(options, processes=1, available_bytes=torch.cuda.get_device_properties(0).total_memory, where="GPU memory")
    else:
        check_memory(options, processes=local, available_bytes=available_memory_bytes(), where="host memory")
    requested = options.requested_sizes()
    item_size = element_size(options.dtype)
    entries = tuple(
        BenchEntry(
            collective=collective,
            variant=variant,
            sizes=tuple(bench_sizes(collective, requested, world_size, item_size)),
            nccl_tests=options.nccl_tests_command(collective, nproc_per_node=local, nnodes=launch_options.nnodes),
        )
        for collective, variant in options.entries()
    )
    return BenchSpec(
        entries=entries,
        backend=backend,
        dtype=options.dtype,
        iters=options.iters,
        warmup=options.warmup,
        check=options.check,
        op=options.op,
        timeout=launch_options.timeout,
    )


def run_bench(options: BenchOptions, *, launch_options: LaunchOptions) -> BenchReport:
    return run_bench_spec(bench_spec(options, launch_options=launch_options), launch_options=launch_options)


def run_bench_spec(spec: BenchSpec, *, launch_options: LaunchOptions, on_row: RowCallback | None = None) -> BenchReport:
    """Launch the ranks; `on_row(entry, size, row)` hears of each size as soon as it is measured
    (global rank 0 writes it to a file this process follows; see stream.py)."""
    if on_row is None:
        returned = launch(bench_worker, spec, options=launch_options)
    else:
        with follow_rows(on_row) as rows_path:
            returned = launch(bench_worker, dataclasses.replace(spec, rows_path=rows_path), options=launch_options)
    # Every rank returns the same combined numbers; take the lowest rank this node ran.
    measured = returned[min(returned)]
    return build_report(spec, measured, world_size=launch_options.world_size)


def table_stream(spec: BenchSpec, *, world_size: int, write: Callable[[str], None]) -> TableStream:
    """Prints `spec`'s tables as their rows are measured (pass its `row` as run_bench_spec's on_row)."""
    empty = build_report(spec, [[] for _ in spec.entries], world_size=world_size)
    return TableStream(empty, [entry.sizes for entry in spec.entries], write)


def collective_result(spec: BenchSpec, entry: BenchEntry, rows: tuple[SizeResult, ...], *, world_size: int) -> CollectiveResult:
    return CollectiveResult(
        collective=entry.collective,
        variant=entry.variant,
        world_size=world_size,
        busbw_factor=busbw_factor(entry.collective, world_size),
        rows=rows,
        note=backend_note(spec.backend, entry.collective, entry.variant),
        op=spec.op if entry.collective in REDUCING else None,
        nccl_tests=entry.nccl_tests,
    )


def build_report(spec: BenchSpec, measured: list, *, world_size: int) -> BenchReport:
    """The report of `measured` (per entry, the measurements of its first sizes: all of them,
    or none for the header of a table still to come)."""
    results = []
    for entry, rows in zip(spec.entries, measured, strict=True):
        size_results = tuple(
            size_result(entry.collective, world_size, size, {mode: None if m is None else (m.seconds, m.wrong) for mode, m in row.items()})
            for size, row in zip(entry.sizes, rows, strict=False)
        )
        results.append(collective_result(spec, entry, size_results, world_size=world_size))
    return BenchReport(
        backend=spec.backend,
        world_size=world_size,
        dtype=spec.dtype,
        iters=spec.iters,
        warmup=spec.warmup,
        check=spec.check,
        results=tuple(results),
    )


def raise_if_wrong(report: BenchReport) -> None:
    """DataCheckError naming where the wrong elements are, if --check found any."""
    if not report.wrong_total:
        return
    places = [
        f"{result.title} {row.size_bytes} B {mode.replace('_', '-')}: {value.wrong}"
        for result in report.results
        for row in result.rows
        for mode, value in row.modes()
        if value is not None and value.wrong
    ]
    shown = "; ".join(places[:3]) + (f"; and {len(places) - 3} more" if len(places) > 3 else "")
    raise DataCheckError(f"--check found {report.wrong_total} wrong result elements ({shown})")
