"""fsdpkit bench without processes: bandwidth arithmetic, sizes, expected values, formatting."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest
import torch

from fsdpkit.bench import patterns
from fsdpkit.bench.busbw import (
    BUSBW_FORMULAS,
    COLLECTIVES,
    BenchSize,
    algbw_gbps,
    bench_sizes,
    busbw_factor,
    busbw_gbps,
    size_sweep,
    valid_size,
)
from fsdpkit.bench.options import BenchOptions, resolve_backend
from fsdpkit.bench.report import CSV_COLUMNS, format_report, report_document, write_csv
from fsdpkit.bench.results import BenchReport, CollectiveResult, size_result
from fsdpkit.bench.runner import raise_if_wrong
from fsdpkit.errors import DataCheckError, UsageError
from fsdpkit.sizes import parse_size

# --- bandwidth arithmetic (nccl-tests doc/PERFORMANCE.md) ---


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 64])
def test_busbw_factors_match_nccl_tests(n):
    assert busbw_factor("allreduce", n) == pytest.approx(2 * (n - 1) / n)
    for collective in ("allgather", "reducescatter", "alltoall"):
        assert busbw_factor(collective, n) == pytest.approx((n - 1) / n)
    assert busbw_factor("broadcast", n) == 1.0


def test_formulas_are_written_for_every_collective():
    assert set(BUSBW_FORMULAS) == set(COLLECTIVES)
    assert BUSBW_FORMULAS["allreduce"] == "busbw = algbw * 2(n-1)/n"
    assert BUSBW_FORMULAS["allgather"] == "busbw = algbw * (n-1)/n"
    assert BUSBW_FORMULAS["broadcast"] == "busbw = algbw * 1"


def test_algbw_is_bytes_per_second_in_1e9_units():
    assert algbw_gbps(2_000_000_000, 2.0) == 1.0
    # 8 ranks all-gather 1 GiB in 10 ms: algbw 107.37 GB/s, busbw * 7/8
    assert busbw_gbps("allgather", 8, 1024**3, 0.010) == pytest.approx(1024**3 / 0.010 / 1e9 * 7 / 8)
    with pytest.raises(ValueError):
        algbw_gbps(1, 0.0)


def test_unknown_collective_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown collective 'gather'"):
        busbw_factor("gather", 2)


# --- sizes ---


def test_size_sweep_follows_min_max_factor():
    assert size_sweep(1024, 8192, 2) == [1024, 2048, 4096, 8192]
    assert size_sweep(1024, 8000, 2) == [1024, 2048, 4096]
    assert size_sweep(1, 100, 10) == [1, 10, 100]
    assert size_sweep(512, 512, 4) == [512]


@pytest.mark.parametrize(
    "args, message",
    [
        ((2048, 1024, 2), "--min-bytes 2048 (2.0 KiB) is larger than --max-bytes 1024 (1.0 KiB)"),
        ((1024, 4096, 1), "--factor must be an integer >= 2, got 1"),
        ((0, 4096, 2), "--min-bytes must be at least 1 byte, got 0"),
    ],
)
def test_size_sweep_rejects_bad_ranges(args, message):
    with pytest.raises(UsageError) as error:
        size_sweep(*args)
    assert str(error.value) == message


def test_sizes_use_the_project_size_parser():
    assert parse_size("1K") == parse_size("1KiB") == 1024
    assert parse_size("1KB") == 1000
    assert parse_size("64M") == 64 * 1024**2
    assert parse_size("64MB") == 64 * 1000**2


def test_sharded_sizes_round_per_rank_share_down_to_16_bytes():
    # 1000 B float32 over 3 ranks: 83 elements each -> 80 (multiple of 4 floats = 16 B) -> size 960.
    assert valid_size("allgather", 1000, 3, 4) == BenchSize(size_bytes=960, count=80)
    assert valid_size("reducescatter", 1000, 3, 4) == BenchSize(size_bytes=960, count=80)
    # bfloat16: multiples of 8 elements per rank.
    assert valid_size("alltoall", 1024, 3, 2) == BenchSize(size_bytes=3 * 168 * 2, count=168)
    # already valid sizes are kept: count is per rank, size is the full tensor.
    assert valid_size("allgather", 1024 * 1024, 2, 4) == BenchSize(size_bytes=1024 * 1024, count=131072)


def test_unsharded_sizes_round_to_whole_elements():
    assert valid_size("allreduce", 1001, 8, 4) == BenchSize(size_bytes=1000, count=250)
    assert valid_size("broadcast", 7, 2, 2) == BenchSize(size_bytes=6, count=3)


def test_bench_sizes_drop_zero_and_repeated_sizes():
    # Over 4 ranks of float32: 16 and 32 B round to 0 per rank; 64 and 96 B both round to 4 floats per rank.
    sizes = bench_sizes("allgather", [16, 32, 64, 96, 128], 4, 4)
    assert sizes == [BenchSize(64, 4), BenchSize(128, 8)]
    with pytest.raises(UsageError, match="smallest valid size is 64 bytes"):
        bench_sizes("allgather", [16, 32], 4, 4)


# --- options, validated before any process starts ---


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"iters": 0}, "--iters must be >= 1, got 0"),
        ({"warmup": -1}, "--warmup must be >= 0, got -1"),
        ({"dtype": "int8"}, "unknown --dtype 'int8'"),
        ({"backend": "mpi"}, "unknown --backend 'mpi'"),
        ({"variant": "tree"}, "unknown --variant 'tree'"),
        ({"collectives": ("gather",)}, "unknown collective 'gather'"),
        ({"factor": 1}, "--factor must be an integer >= 2"),
    ],
)
def test_bench_options_reject_bad_values(overrides, message):
    arguments = {"collectives": ("allgather",), **overrides}
    with pytest.raises(UsageError, match=message):
        BenchOptions(**arguments)


def test_variant_all_runs_flat_list_then_fsdpkit():
    options = BenchOptions(collectives=("allgather", "allreduce"), variant="all")
    assert options.entries() == [("allgather", "flat"), ("allgather", "list"), ("allgather", "fsdpkit"), ("allreduce", "")]


def test_nccl_without_cuda_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert resolve_backend("auto", nproc_per_node=2) == "gloo"
    with pytest.raises(UsageError, match="--backend nccl needs CUDA"):
        resolve_backend("nccl", nproc_per_node=1)


def test_nccl_with_more_processes_than_gpus_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_backend("auto", nproc_per_node=2) == "nccl"
    assert resolve_backend("auto", nproc_per_node=4) == "gloo"
    with pytest.raises(UsageError, match="--nproc-per-node 4 is more than nccl can run here: one process per GPU and this node has 2"):
        resolve_backend("nccl", nproc_per_node=4)


# --- expected values, against a single-process reference of each collective ---


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_expected_values_match_a_single_process_reference(n):
    count, cpu = 24, torch.device("cpu")
    inputs = [patterns.moved_values(rank, count, dtype=torch.float32, device=cpu) for rank in range(n)]
    assert torch.equal(patterns.gathered_values(n, count, device=cpu), torch.cat(inputs).double())

    full_inputs = [patterns.summed_values(rank, 0, count * n, dtype=torch.bfloat16, device=cpu) for rank in range(n)]
    reference_sum = torch.stack([x.double() for x in full_inputs]).sum(0)
    assert torch.equal(patterns.sum_over_ranks(0, count * n, n, device=cpu), reference_sum)
    for rank in range(n):  # reduce-scatter: chunk `rank` of the sum
        chunk = reference_sum[rank * count : (rank + 1) * count]
        assert torch.equal(patterns.sum_over_ranks(rank * count, count, n, device=cpu), chunk)

    sends = [patterns.alltoall_input(rank, n, count, dtype=torch.float16, device=cpu).double() for rank in range(n)]
    for rank in range(n):  # all-to-all: receive chunk s = sender s's chunk `rank`
        reference = torch.cat([sends[sender][rank * count : (rank + 1) * count] for sender in range(n)])
        assert torch.equal(patterns.alltoall_expected(rank, n, count, device=cpu), reference)


def test_expected_values_detect_misplaced_chunks():
    cpu = torch.device("cpu")
    gathered = patterns.gathered_values(4, 16, device=cpu)
    swapped = torch.cat([gathered[16:32], gathered[:16], gathered[32:]])
    assert patterns.count_wrong(swapped, gathered) > 0
    summed = patterns.sum_over_ranks(0, 32, 2, device=cpu)
    assert patterns.count_wrong(summed[16:], summed[:16]) > 0


def test_values_are_exact_in_every_dtype():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        values = patterns.moved_values(7, 100, dtype=dtype, device=cpu)
        assert torch.equal(values.double(), patterns.moved_values(7, 100, dtype=torch.float64, device=cpu))
        assert patterns.tolerance(dtype, 2) == 0.0
    assert patterns.tolerance(torch.bfloat16, 64) > 0  # sums above 256 are not exact in bfloat16


def test_count_wrong_counts_nan_and_differences():
    expected = torch.arange(1, 9, dtype=torch.float64)
    result = expected.float().clone()
    assert patterns.count_wrong(result, expected) == 0
    result[2] = float("nan")
    result[5] = -1
    assert patterns.count_wrong(result, expected) == 2


# --- results and their formats ---


def _report(*, check: bool, wrong: int = 0) -> BenchReport:
    sizes = [BenchSize(1024, 128), BenchSize(2048, 256)]
    allgather = CollectiveResult(
        collective="allgather",
        variant="flat",
        world_size=2,
        busbw_factor=busbw_factor("allgather", 2),
        rows=tuple(
            size_result("allgather", 2, s, {"out_of_place": (1e-5, wrong if check else None), "in_place": (2e-5, 0 if check else None)})
            for s in sizes
        ),
    )
    allreduce = CollectiveResult(
        collective="allreduce",
        variant="",
        world_size=2,
        busbw_factor=busbw_factor("allreduce", 2),
        rows=tuple(size_result("allreduce", 2, s, {"out_of_place": None, "in_place": (4e-5, 0 if check else None)}) for s in sizes),
        note="a note about the backend",
    )
    return BenchReport(backend="gloo", world_size=2, dtype="float32", iters=3, warmup=1, check=check, results=(allgather, allreduce))


def test_size_result_computes_algbw_and_busbw():
    row = size_result("allreduce", 4, BenchSize(4_000_000, 1_000_000), {"out_of_place": None, "in_place": (0.002, 0)})
    assert row.out_of_place is None
    assert row.in_place.time_us == pytest.approx(2000.0)
    assert row.in_place.algbw_gbps == pytest.approx(2.0)
    assert row.in_place.busbw_gbps == pytest.approx(2.0 * 1.5)


def test_table_has_nccl_tests_columns_and_average():
    report = _report(check=True)
    text = format_report(report)
    lines = text.splitlines()
    assert any("out-of-place" in line and "in-place" in line for line in lines)
    header = next(line for line in lines if "#wrong" in line)
    assert header.split()[1:] == ["size", "count", "type"] + ["time", "algbw", "busbw", "#wrong"] * 2
    rows = [line.split() for line in lines if not line.startswith("#")]
    assert len(rows) == 4 and all(len(row) == 11 for row in rows)
    assert rows[0][:3] == ["1024", "128", "float32"]
    assert rows[0][3] == "10.0"  # time (us)
    assert rows[0][4] == "0.10" and rows[0][5] == "0.05"  # 1024 B / 10 us = 0.1024 GB/s; busbw * 1/2
    assert rows[2][3:7] == ["N/A"] * 4  # all_reduce has no out-of-place form in torch
    averages = [line for line in lines if line.startswith("# Avg bus bandwidth")]
    assert len(averages) == 2
    expected_average = (1024 / 1e-5 + 1024 / 2e-5 + 2048 / 1e-5 + 2048 / 2e-5) / 4 / 1e9 * 0.5
    assert float(averages[0].split(":")[1]) == pytest.approx(expected_average, rel=1e-5)
    assert "busbw = algbw * 2(n-1)/n" in text and "# note: a note about the backend" in text


def test_json_document_has_formulas_and_fields():
    document = json.loads(json.dumps(report_document(_report(check=False))))
    assert document["backend"] == "gloo" and document["world_size"] == 2 and document["wrong_total"] is None
    allgather, allreduce = document["results"]
    assert allgather["busbw_formula"] == "busbw = algbw * (n-1)/n" and allgather["busbw_factor"] == 0.5
    assert allgather["algbw_formula"] == "algbw = size / time"
    assert allreduce["busbw_factor"] == 1.0 and allreduce["rows"][0]["out_of_place"] is None
    row = allgather["rows"][1]
    assert row["size_bytes"] == 2048 and row["count"] == 256
    assert set(row["in_place"]) == {"time_us", "algbw_gbps", "busbw_gbps", "wrong"}
    assert row["in_place"]["wrong"] is None


def test_csv_has_one_row_per_measured_mode():
    stream = io.StringIO()
    write_csv(_report(check=True), stream)
    rows = list(csv.DictReader(io.StringIO(stream.getvalue())))
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert len(rows) == 2 * 2 + 2  # allgather: 2 sizes x 2 modes; allreduce: 2 sizes x in-place
    assert {row["mode"] for row in rows if row["collective"] == "allreduce"} == {"in_place"}
    assert math.isclose(float(rows[0]["time_us"]), 10.0)


def test_wrong_elements_raise_a_data_check_error():
    raise_if_wrong(_report(check=True, wrong=0))
    with pytest.raises(DataCheckError, match="--check found 2 wrong result elements") as error:
        raise_if_wrong(_report(check=True, wrong=1))
    assert error.value.exit_code == 3
