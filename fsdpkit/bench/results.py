"""Benchmark results with their bandwidths, as the table, JSON and CSV show them."""

from __future__ import annotations

from dataclasses import dataclass

from .busbw import ALGBW_FORMULA, BUSBW_FORMULAS, MODES, BenchSize, algbw_gbps, busbw_factor


@dataclass(frozen=True)
class ModeResult:
    time_us: float  # max over ranks of each rank's mean
    algbw_gbps: float
    busbw_gbps: float
    wrong: int | None  # None without --check


@dataclass(frozen=True)
class SizeResult:
    size_bytes: int
    count: int
    out_of_place: ModeResult | None  # None: the collective has no such form in torch
    in_place: ModeResult | None

    def modes(self) -> list[tuple[str, ModeResult | None]]:
        return [("out_of_place", self.out_of_place), ("in_place", self.in_place)]


@dataclass(frozen=True)
class CollectiveResult:
    collective: str
    variant: str  # all-gather: flat|list; reduce-scatter: torch|fsdpkit; else ""
    world_size: int
    busbw_factor: float
    rows: tuple[SizeResult, ...]
    note: str | None = None  # what the backend really runs, where that matters
    op: str | None = None  # the reduction, for all-reduce and reduce-scatter
    nccl_tests: str = ""  # the nccl-tests command line that measures the same thing

    @property
    def title(self) -> str:
        return f"{self.collective} ({self.variant})" if self.variant else self.collective

    @property
    def busbw_formula(self) -> str:
        return BUSBW_FORMULAS[self.collective]

    @property
    def algbw_formula(self) -> str:
        return ALGBW_FORMULA

    @property
    def avg_busbw_gbps(self) -> float:
        """Mean busbw over every size and mode measured (nccl-tests' '# Avg bus bandwidth')."""
        values = [mode.busbw_gbps for row in self.rows for _, mode in row.modes() if mode is not None]
        return sum(values) / len(values) if values else 0.0

    @property
    def wrong_total(self) -> int | None:
        counts = [mode.wrong for row in self.rows for _, mode in row.modes() if mode is not None and mode.wrong is not None]
        return sum(counts) if counts else None


@dataclass(frozen=True)
class BenchReport:
    backend: str
    world_size: int
    dtype: str
    iters: int
    warmup: int
    check: int  # result checks per size and mode (0: none)
    results: tuple[CollectiveResult, ...]

    @property
    def wrong_total(self) -> int | None:
        counts = [result.wrong_total for result in self.results if result.wrong_total is not None]
        return sum(counts) if self.check else None


def mode_result(collective: str, world_size: int, size_bytes: int, seconds: float, wrong: int | None) -> ModeResult:
    algbw = algbw_gbps(size_bytes, seconds)
    return ModeResult(
        time_us=seconds * 1e6,
        algbw_gbps=algbw,
        busbw_gbps=algbw * busbw_factor(collective, world_size),
        wrong=wrong,
    )


def size_result(
    collective: str, world_size: int, size: BenchSize, seconds_by_mode: dict[str, tuple[float, int | None] | None]
) -> SizeResult:
    """seconds_by_mode: mode -> (max-over-ranks mean seconds, wrong count) or None."""
    modes = {}
    for mode in MODES:
        measured = seconds_by_mode.get(mode)
        modes[mode] = None if measured is None else mode_result(collective, world_size, size.size_bytes, *measured)
    return SizeResult(size_bytes=size.size_bytes, count=size.count, **modes)
