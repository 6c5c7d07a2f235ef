"""Benchmark variants without processes: which implementations run, what bad --variant
values say, and the side-by-side table `fsdpkit bench reducescatter --variant all` prints
(the launcher is replaced by one returning fixed timings; the fsdpkit reduce-scatter's
results are checked against all-reduce in test_engine_zoo.py)."""

from __future__ import annotations

import pytest
from fsdpkit_cli.app import app
from typer.testing import CliRunner

from fsdpkit.bench import runner as bench_runner
from fsdpkit.bench.options import BenchOptions
from fsdpkit.bench.worker import Measurement
from fsdpkit.errors import UsageError


def test_each_collective_has_its_own_variants_and_default():
    assert BenchOptions(collectives=("allgather", "reducescatter", "allreduce")).entries() == [
        ("allgather", "flat"),
        ("reducescatter", "torch"),
        ("allreduce", ""),
    ]
    assert BenchOptions(collectives=("reducescatter",), variant="all").entries() == [
        ("reducescatter", "torch"),
        ("reducescatter", "fsdpkit"),
    ]
    assert BenchOptions(collectives=("reducescatter",), variant="fsdpkit").entries() == [("reducescatter", "fsdpkit")]


@pytest.mark.parametrize(
    "collectives, variant, message",
    [
        (("reducescatter",), "flat", "unknown --variant 'flat': choose from torch, fsdpkit, all"),
        (("allgather",), "torch", "unknown --variant 'torch': choose from flat, list, fsdpkit, all"),
        (("allreduce",), "all", "--variant only applies to allgather, reducescatter"),
    ],
)
def test_bad_variants_are_named(collectives, variant, message):
    with pytest.raises(UsageError, match=message):
        BenchOptions(collectives=collectives, variant=variant)


def test_reducescatter_all_prints_torch_and_fsdpkit_side_by_side(monkeypatch):
    seen = {}

    def fake_launch(worker, plan, *, options):
        seen["variants"] = [entry.variant for entry in plan.entries]
        timing = {"torch": 2e-3, "fsdpkit": 1e-3}
        return {
            0: [
                [
                    {"out_of_place": Measurement(timing[entry.variant], None), "in_place": Measurement(timing[entry.variant], None)}
                    for _ in entry.sizes
                ]
                for entry in plan.entries
            ]
        }

    monkeypatch.setattr(bench_runner, "launch", fake_launch)
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "reducescatter",
            "--variant",
            "all",
            "--nproc-per-node",
            "2",
            "--backend",
            "gloo",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "2K",
        ],
    )
    assert result.exit_code == 0, result.output
    assert seen["variants"] == ["torch", "fsdpkit"]
    lines = result.stdout.splitlines()
    assert any("emulated" in line for line in lines) and any("point-to-point" in line for line in lines)
    start = lines.index(next(line for line in lines if line.startswith("# reduce-scatter: torch")))
    assert lines[start + 1].split()[1:] == ["size(B)", "mode", "torch(us)", "fsdpkit(us)", "fsdpkit/torch"]
    assert [line.split() for line in lines[start + 2 : start + 6]] == [
        [size, mode, "2000.0", "1000.0", "0.50"] for size in ("1024", "2048") for mode in ("out-of-place", "in-place")
    ]
