"""Benchmark results as people already read them: the nccl-tests table, one JSON document, CSV."""

from __future__ import annotations

import csv
from typing import Any, TextIO

from .busbw import MODES
from .results import BenchReport, CollectiveResult, ModeResult, SizeResult

_MODE_HEADER = f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>7}"
_MODE_UNITS = f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>7}"
_NOT_AVAILABLE = f"{'N/A':>9} {'N/A':>7} {'N/A':>7} {'N/A':>7}"


def format_report(report: BenchReport) -> str:
    """Every collective's table, one after another; the variants side by side when both ran."""
    parts = [format_table(report, result) for result in report.results]
    comparison = format_variant_comparison(report)
    if comparison:
        parts.append(comparison)
    return "\n".join(parts)


def format_table(report: BenchReport, result: CollectiveResult) -> str:
    lines = [*table_header(report, result), *(table_row(report, row) for row in result.rows), *table_footer(report, result)]
    return "\n".join(lines)


def table_header(report: BenchReport, result: CollectiveResult) -> list[str]:
    """A collective's table up to its first row (what it measures, the formulas, the columns)."""
    lines = [
        f"# fsdpkit bench {result.title}: {report.world_size} ranks, backend {report.backend}, "
        f"iters {report.iters}, warmup {report.warmup}" + (f", op {result.op}" if result.op else ""),
        f"# nccl-tests: {result.nccl_tests}",
        f"# {result.algbw_formula} ; {result.busbw_formula} ({result.busbw_factor:g} for n={report.world_size}) ; "
        "time = max over ranks of each rank's mean",
    ]
    if result.note:
        lines.append(f"# note: {result.note}")
    lines += [
        "#",
        f"# {'':>11} {'':>12} {'':>9}  {'out-of-place':^33}  {'in-place':^33}",
        f"# {'size':>11} {'count':>12} {'type':>9}  {_MODE_HEADER}  {_MODE_HEADER}",
        f"# {'(B)':>11} {'(elements)':>12} {'':>9}  {_MODE_UNITS}  {_MODE_UNITS}",
    ]
    return [line.rstrip() for line in lines]


def table_row(report: BenchReport, row: SizeResult) -> str:
    cells = "  ".join(_format_mode(mode) for _, mode in row.modes())
    return f"  {row.size_bytes:>11} {row.count:>12} {report.dtype:>9}  {cells}".rstrip()


def table_footer(report: BenchReport, result: CollectiveResult) -> list[str]:
    lines = []
    if report.check:
        lines.append(f"# Out of bounds values : {result.wrong_total} {'OK' if not result.wrong_total else 'FAILED'}")
    lines.append(f"# Avg bus bandwidth    : {result.avg_busbw_gbps:.6g}")
    lines.append("#")
    return lines


def _format_mode(mode: ModeResult | None) -> str:
    if mode is None:
        return _NOT_AVAILABLE
    wrong = "N/A" if mode.wrong is None else str(mode.wrong)
    return f"{_format_time(mode.time_us):>9} {mode.algbw_gbps:>7.2f} {mode.busbw_gbps:>7.2f} {wrong:>7}"


def _format_time(time_us: float) -> str:
    return f"{time_us:.1f}" if time_us < 1e6 else f"{time_us:.0f}"


_COMPARISONS = {  # collective -> (title, baseline variant, the other variants)
    "allgather": (
        "all-gather: flat (all_gather_single, FSDP's) vs list (all_gather into separate tensors) "
        "vs fsdpkit (the engine's Collectives.all_gather)",
        "flat",
        ("list", "fsdpkit"),
    ),
    "reducescatter": (
        "reduce-scatter: torch (reduce_scatter_single) vs fsdpkit (the engine's Collectives.reduce_scatter)",
        "torch",
        ("fsdpkit",),
    ),
}


def format_variant_comparison(report: BenchReport) -> str | None:
    """Each collective's variants side by side at each size, with each one's time over the
    baseline's, when more than one ran."""
    parts = []
    for collective, (title, base, others) in _COMPARISONS.items():
        by_variant = {result.variant: result for result in report.results if result.collective == collective}
        ran = [other for other in others if other in by_variant]
        if base not in by_variant or not ran:
            continue
        times = "".join(f" {variant + '(us)':>12}" for variant in (base, *ran))
        ratios = "".join(f" {other + '/' + base:>13}" for other in ran)
        lines = [f"# {title}", f"# {'size(B)':>11} {'mode':>13}{times}{ratios}"]
        for rows in zip(*(by_variant[variant].rows for variant in (base, *ran)), strict=True):
            for mode in MODES:
                base_us, *other_us = (getattr(row, mode).time_us for row in rows)
                line = f"  {rows[0].size_bytes:>11} {mode.replace('_', '-'):>13}" + "".join(f" {t:>12.1f}" for t in (base_us, *other_us))
                lines.append(line + "".join(f" {t / base_us:>13.2f}" for t in other_us))
        lines.append("#")
        parts.append("\n".join(lines))
    return "\n".join(parts) or None


def report_document(report: BenchReport) -> dict[str, Any]:
    """The --json document."""
    return {
        "command": "bench",
        "backend": report.backend,
        "world_size": report.world_size,
        "dtype": report.dtype,
        "iters": report.iters,
        "warmup": report.warmup,
        "check": report.check,
        "time": "max over ranks of each rank's mean time per call, in microseconds",
        "units": {"size": "bytes", "time": "us", "algbw": "GB/s (1e9 bytes/s)", "busbw": "GB/s (1e9 bytes/s)"},
        "wrong_total": report.wrong_total,
        "results": [_result_document(result) for result in report.results],
    }


def _result_document(result: CollectiveResult) -> dict[str, Any]:
    return {
        "collective": result.collective,
        "variant": result.variant or None,
        "op": result.op,
        "nccl_tests": result.nccl_tests,
        "algbw_formula": result.algbw_formula,
        "busbw_formula": result.busbw_formula,
        "busbw_factor": result.busbw_factor,
        "note": result.note,
        "avg_busbw_gbps": result.avg_busbw_gbps,
        "wrong_total": result.wrong_total,
        "rows": [
            {"size_bytes": row.size_bytes, "count": row.count, **{mode: _mode_document(value) for mode, value in row.modes()}}
            for row in result.rows
        ],
    }


def _mode_document(mode: ModeResult | None) -> dict[str, Any] | None:
    if mode is None:
        return None
    return {"time_us": mode.time_us, "algbw_gbps": mode.algbw_gbps, "busbw_gbps": mode.busbw_gbps, "wrong": mode.wrong}


CSV_COLUMNS = (
    "collective",
    "variant",
    "backend",
    "world_size",
    "size_bytes",
    "count",
    "type",
    "mode",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "busbw_factor",
    "wrong",
)


def write_csv(report: BenchReport, stream: TextIO) -> None:
    """One row per collective, size and mode that ran."""
    writer = csv.writer(stream)
    writer.writerow(CSV_COLUMNS)
    for result in report.results:
        for row in result.rows:
            for mode, value in row.modes():
                if value is None:
                    continue
                writer.writerow(
                    [
                        result.collective,
                        result.variant,
                        report.backend,
                        report.world_size,
                        row.size_bytes,
                        row.count,
                        report.dtype,
                        mode,
                        f"{value.time_us:.3f}",
                        f"{value.algbw_gbps:.6g}",
                        f"{value.busbw_gbps:.6g}",
                        f"{result.busbw_factor:g}",
                        "" if value.wrong is None else value.wrong,
                    ]
                )
