"""`fsdpkit bench` through the CLI: real 2-process gloo runs (four launches), nccl-tests'
short flags, and bad input.

Each launch costs ~3 s, so each one checks many things; bad input is rejected before any
launch (the launcher is replaced by one that fails the test if it is ever called).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.bench import patterns
from fsdpkit.bench.options import BenchOptions, parse_dtype

SMALL = ["--nproc-per-node", "2", "--backend", "gloo", "--min-bytes", "1K", "--max-bytes", "4K", "--iters", "2", "--warmup", "1"]
SHORT = ["--nproc_per_node", "2", "--backend", "gloo", "-b", "1K", "-e", "4K", "-f", "2", "-n", "2", "-w", "1"]  # nccl-tests, torchrun


def _invoke(args, env=None):
    return CliRunner().invoke(app, ["bench", *args], env=env)


def test_all_collectives_json_check_passes_and_csv(tmp_path):
    csv_path = tmp_path / "bench.csv"
    result = _invoke(["all", *SHORT, "-c", "1", "-o", "max", "-d", "float", "--json", "--csv", str(csv_path)])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)  # exactly one JSON document on stdout
    assert result.stdout.count("\n") == 1
    assert document["backend"] == "gloo" and document["world_size"] == 2 and document["dtype"] == "float32"
    assert document["check"] == 1 and document["wrong_total"] == 0
    by_name = {entry["collective"]: entry for entry in document["results"]}
    assert list(by_name) == ["allgather", "reducescatter", "allreduce", "broadcast", "alltoall"]
    assert by_name["allreduce"]["busbw_formula"] == "busbw = algbw * 2(n-1)/n" and by_name["allreduce"]["busbw_factor"] == 1.0
    assert by_name["broadcast"]["busbw_factor"] == 1.0 and by_name["allgather"]["busbw_factor"] == 0.5
    assert "emulated" in by_name["reducescatter"]["note"]
    assert by_name["allreduce"]["op"] == "max" and by_name["allgather"]["op"] is None  # checked against max over ranks
    assert by_name["allreduce"]["nccl_tests"] == "mpirun -np 2 all_reduce_perf -b 1024 -e 4096 -f 2 -n 2 -w 1 -c 1 -d float -o max -g 1"
    assert by_name["alltoall"]["nccl_tests"] == "mpirun -np 2 alltoall_perf -b 1024 -e 4096 -f 2 -n 2 -w 1 -c 1 -d float -g 1"
    for name, entry in by_name.items():
        assert [row["size_bytes"] for row in entry["rows"]] == [1024, 2048, 4096]
        for row in entry["rows"]:
            measured = [mode for mode in ("out_of_place", "in_place") if row[mode] is not None]
            expected_modes = {"allreduce": ["in_place"], "broadcast": ["in_place"], "alltoall": ["out_of_place"]}
            assert measured == expected_modes.get(name, ["out_of_place", "in_place"])
            for mode in measured:
                values = row[mode]
                assert values["wrong"] == 0 and values["time_us"] > 0
                assert values["algbw_gbps"] == pytest.approx(row["size_bytes"] / values["time_us"] / 1e3)
                assert values["busbw_gbps"] == pytest.approx(values["algbw_gbps"] * entry["busbw_factor"])
    # size is the full tensor, count per rank, for the sharded collectives
    assert by_name["allgather"]["rows"][0]["count"] == 1024 // 4 // 2
    assert by_name["allreduce"]["rows"][0]["count"] == 1024 // 4
    with open(csv_path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 3 * (2 + 2 + 1 + 1 + 1)
    assert {row["wrong"] for row in rows} == {"0"}


def test_table_counts_a_corrupted_result_as_wrong_and_exits_3():
    args = ["allgather", *SMALL, "--variant", "all", "--dtype", "bfloat16", "--check", "2"]
    result = _invoke(args, env={"FSDPKIT_BENCH_CORRUPT_RANK": "1"})
    assert result.exit_code == 3, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("# fsdpkit bench allgather (flat): 2 ranks, backend gloo")
    assert lines[1] == "# nccl-tests: mpirun -np 2 all_gather_perf -b 1024 -e 4096 -f 2 -n 2 -w 1 -c 2 -d bfloat16 -g 1"
    header = next(line for line in lines if "#wrong" in line)
    assert header.split()[1:] == ["size", "count", "type"] + ["time", "algbw", "busbw", "#wrong"] * 2
    rows = [line.split() for line in lines if line.startswith("  ") and "float" in line]
    assert len(rows) == 3 * 3  # flat, list and fsdpkit tables, three sizes each
    for row in rows:
        assert row[2] == "bfloat16" and len(row) == 11
        assert row[6] == "2" and row[10] == "2"  # rank 1 corrupted one element in each of the 2 checked runs
    assert [row[:2] for row in rows[:3]] == [["1024", "256"], ["2048", "512"], ["4096", "1024"]]
    assert sum(line.startswith("# Avg bus bandwidth") for line in lines) == 3
    assert any(line.startswith("# all-gather: flat") for line in lines)  # side by side
    assert result.stderr.strip().splitlines() == [
        "error: --check found 36 wrong result elements (allgather (flat) 1024 B out-of-place: 2; "
        "allgather (flat) 1024 B in-place: 2; allgather (flat) 2048 B out-of-place: 2; and 15 more)"
    ]


def test_worker_failure_exits_1_with_rank_and_reason():
    result = _invoke(["allreduce", *SMALL], env={"FSDPKIT_BENCH_FAIL_RANK": "1"})
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: worker rank 1 failed: RuntimeError: injected failure (FSDPKIT_BENCH_FAIL_RANK=1)"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["allgather", "--min-bytes", "2M", "--max-bytes", "1M"],
            "error: --min-bytes 2097152 (2.0 MiB) is larger than --max-bytes 1048576 (1.0 MiB)",
        ),
        (["allgather", "--factor", "1"], "error: --factor must be an integer >= 2, got 1"),
        (["allreduce", "--iters", "0"], "error: --iters must be >= 1, got 0"),
        (["gather"], "error: unknown collective 'gather': choose from allgather, reducescatter, allreduce, broadcast, alltoall, all"),
        (
            ["--nproc-per-node", "2"],
            "error: missing collective before --nproc-per-node: fsdpkit bench COLLECTIVE [OPTIONS], with COLLECTIVE one of allgather,",
        ),
        (
            ["broadcast", "--dtype", "int8"],
            "error: unknown --dtype 'int8': choose from float32, bfloat16, float16 (nccl-tests: float, half, bfloat16)",
        ),
        (["allreduce", "-o", "avg", "--backend", "gloo"], "error: --op avg needs nccl: gloo has no average reduction"),
        (
            ["allreduce", "-o", "prod", "-c", "1", "-d", "half", "--nproc-per-node", "8", "--backend", "gloo"],
            "error: --op prod --check overflows float16 on 8 ranks: use float32 or no --check",
        ),
        (
            ["allgather", "-e", "1000T", "--backend", "gloo"],
            "error: --max-bytes 1099511627776000 (1000.0 TiB) needs about 4000.0 TiB of host memory for 2 processes, more than",
        ),
        (["allgather", "-c", "-1"], "error: --check must be >= 0, got -1"),
        (
            ["allgather", "--nnodes", "2"],
            "error: --nnodes 2 needs --rdzv-endpoint HOST:PORT (or --master-addr HOST) that every node can reach",
        ),
        (["allgather", "--standalone", "--rdzv-endpoint", "h:1"], "error: --standalone runs on one node with a local rendezvous"),
        (["allgather", "--bogus"], "error: no such option: --bogus (see 'fsdpkit bench allgather --help')"),
        (["allgather", "-n", "x"], "error: invalid value for '--iters' / '-n'"),
        (["allgather", "--variant", "ring"], "error: unknown --variant 'ring': choose from flat, list, fsdpkit, all"),
        (
            ["all", "--min-bytes", "12Q"],
            "error: unknown size unit 'Q' in '12Q': use K/M/G (=KiB/MiB/GiB, powers of 1024) or KB/MB/GB (powers of 1000)",
        ),
        (["alltoall", "--nproc-per-node", "65"], "error: --nproc-per-node 65 is more than this launcher allows per node (64)"),
        (
            ["allgather", "--nproc-per-node", "4", "--min-bytes", "16", "--max-bytes", "32"],
            "error: --max-bytes 32 is too small for allgather over 4 ranks with 4-byte elements: the smallest valid size is 64 bytes",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(no_launch, args, message):
    result = _invoke(args)
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_nccl_requests_are_checked_before_launching(no_launch, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    result = _invoke(["allgather", "--backend", "nccl", "--nproc-per-node", "1"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == ["error: --backend nccl needs CUDA, but torch sees no CUDA device here: use --backend gloo"]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    result = _invoke(["allgather", "--backend", "nccl", "--nproc-per-node", "2"])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "error: --nproc-per-node 2 is more than nccl can run here: one process per GPU and this node has 1"
    ]


def test_help_shows_the_bandwidth_formulas():
    result = _invoke(["allreduce", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "busbw = algbw * 2(n-1)/n" in text
    assert "allgather, reducescatter, alltoall (n-1)/n; broadcast 1" in text


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_expected_reductions_match_a_single_process_reference(op, n):
    cpu = torch.device("cpu")
    inputs = torch.stack([patterns.summed_values(rank, 0, 40, dtype=torch.float64, device=cpu) for rank in range(n)])
    reference = {
        "sum": inputs.sum(0),
        "prod": inputs.prod(0),
        "min": inputs.min(0).values,
        "max": inputs.max(0).values,
        "avg": inputs.mean(0),
    }[op]
    assert torch.allclose(patterns.reduced_over_ranks(op, 0, 40, n, device=cpu), reference, rtol=1e-15)
    assert torch.allclose(patterns.reduced_over_ranks(op, 10, 20, n, device=cpu), reference[10:30], rtol=1e-15)


def test_nccl_tests_dtype_names_and_command_line():
    options = BenchOptions(
        collectives=("allgather", "reducescatter"),
        dtype=parse_dtype("half"),
        min_bytes=8,
        max_bytes=1024,
        factor=4,
        iters=3,
        warmup=0,
        check=1,
        op="min",
    )
    assert options.dtype == "float16" and parse_dtype("float") == "float32" and parse_dtype("bfloat16") == "bfloat16"
    assert (
        options.nccl_tests_command("allgather", nproc_per_node=8, nnodes=2)
        == "mpirun -np 16 all_gather_perf -b 8 -e 1024 -f 4 -n 3 -w 0 -c 1 -d half -g 1"
    )
    assert options.nccl_tests_command("reducescatter", nproc_per_node=1, nnodes=1).endswith("-d half -o min -g 1")


def test_rows_arrive_through_a_pipe_while_the_benchmark_runs():
    """Read from a pipe, as `fsdpkit bench ... | tee` would: the header comes first, then each
    row as its size is measured, while the process still runs (the timeline in the message)."""
    command = [sys.executable, "-m", "fsdpkit_cli", "bench", "allgather", *SMALL[:4], "-b", "1K", "-e", "1M", "-f", "4", "-n", "20"]
    started = time.perf_counter()
    process = subprocess.Popen(
        [*command, "--variant", "all"], stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    arrivals = []  # (seconds since start, the process still running, line)
    for line in process.stdout:
        arrivals.append((time.perf_counter() - started, process.poll() is None, line.rstrip("\n")))
    assert process.wait(timeout=300) == 0
    ended = time.perf_counter() - started
    rows = [(at, running) for at, running, line in arrivals if line.startswith("  ") and "float32" in line]
    timeline = (
        "\n".join(f"{at:7.3f} {'running' if running else 'exited '} {line}" for at, running, line in arrivals) + f"\n{ended:7.3f} end"
    )
    assert arrivals[0][2].startswith("# fsdpkit bench allgather (flat)") and arrivals[0][1], timeline
    assert len(rows) == 3 * 6 and rows[0][1], timeline  # the first row came while the process still ran
    assert rows[0][0] < rows[-1][0] < ended, timeline


def test_csv_into_a_read_only_directory_is_one_line_before_launch(tmp_path, no_launch, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)]).returncode == 0
    try:
        if not mounted:
            if os.geteuid() == 0:  # root writes through permissions: answer as a read-only filesystem would
                monkeypatch.setattr(os, "access", lambda path, mode: not str(path).startswith(str(read_only)))
            else:
                read_only.chmod(0o555)
        result = _invoke(["allreduce", *SMALL, "--csv", str(read_only / "bench.csv")])
    finally:
        if mounted:
            subprocess.run(["umount", str(read_only)], check=True)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [f"error: --csv '{read_only / 'bench.csv'}': directory '{read_only}' is not writable"]
    assert list(read_only.iterdir()) == []
