"""`convert --to full --dtype bf16` of an fp32 fsdpkit checkpoint (a CPU-bound conversion: every
element is cast) with `--nproc-per-node 2` against 1, on this machine, side by side:

    .venv/bin/python benchmarks/spread_speedup.py                 # 2 GiB of fp32 weights, 5 rounds
    .venv/bin/python benchmarks/spread_speedup.py --gib 0.5 --rounds 5 --json

Makes the source once in a temporary directory (random fp32 tensors of 64 MiB, written as full
safetensors by numpy, converted --to sharded --world-size 2), then, --rounds times, runs each
command in its own process in turn (the plain one-process command, --nproc-per-node 1, 2),
each into a new output directory removed afterwards, its wall time including the start of
its processes, the slowest rank's own work (`--json`'s `spread.ranks[].seconds`: no start, no
planning), what is left (starting, opening the source, planning, committing), and the peak RSS
of the process tree's largest process. Reports, for the wall time and for the work alone, the
median and the range of the ratios of 2 processes to 1 per round, and the load average at the
start of each round: on a shared machine only ratios measured side by side mean much, and their
spread (and the load) says how much.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy

TENSOR_MIB = 64


def make_source(root: Path, gib: float) -> Path:
    from safetensors.numpy import save_file

    rng = numpy.random.default_rng(0)
    count = max(1, int(gib * 1024 / TENSOR_MIB))
    full = root / "full"
    full.mkdir()
    for index in range(count):
        save_file(
            {f"layer.{index}.weight": rng.standard_normal(TENSOR_MIB << 18, dtype=numpy.float32).reshape(-1, 1024)},
            full / f"part{index}.safetensors",
        )
    names = [f"part{index}.safetensors" for index in range(count)]
    weight_map = {f"layer.{index}.weight": names[index] for index in range(count)}
    (full / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    source = root / "sharded"
    subprocess.run(
        [sys.executable, "-m", "fsdpkit_cli", "convert", str(full), str(source), "--to", "sharded", "--world-size", "2"], check=True
    )
    shutil.rmtree(full)
    return source


def timed(command: list[str]) -> tuple[float, float, float | None]:
    """(wall seconds, peak RSS in MB of the largest process of its tree, seconds of the slowest
    rank's own work as --json reports it: the wall time less starting processes and planning)."""
    started = time.perf_counter()
    done = subprocess.run([*command, "--json"], check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seconds = time.perf_counter() - started
    spread = json.loads(done.stdout).get("spread")
    work = max(rank["seconds"] for rank in spread["ranks"]) if spread else None
    return seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fsdpkit-spread-", dir=os.environ.get("TMPDIR")) as tmp:
        source = make_source(Path(tmp), args.gib)
        base = [sys.executable, "-m", "fsdpkit_cli", "convert", str(source)]
        flags = ["--to", "full", "--dtype", "bf16", "--max-shard-size", "256MB"]
        variants = {"plain": [], "nproc1": ["--nproc-per-node", "1"], "nproc2": ["--nproc-per-node", "2"]}
        times: dict[str, list[float]] = {name: [] for name in variants}
        work: dict[str, list[float]] = {name: [] for name in variants if name != "plain"}
        peak, loads = 0.0, []
        for round_number in range(args.rounds):
            loads.append(round(os.getloadavg()[0], 2))
            for name, extra in variants.items():
                out = Path(tmp) / f"out-{name}-{round_number}"
                seconds, rss, ranks_seconds = timed([*base, str(out), *flags, *extra])
                times[name].append(seconds)
                if ranks_seconds is not None:
                    work[name].append(ranks_seconds)
                peak = max(peak, rss)
                shutil.rmtree(out)
        ratios = [two / one for two, one in zip(times["nproc2"], times["nproc1"], strict=True)]
        work_ratios = [two / one for two, one in zip(work["nproc2"], work["nproc1"], strict=True)]
    rest = {name: [wall - own for wall, own in zip(times[name], work[name], strict=True)] for name in work}
    result = {
        "gib": args.gib,
        "cpus": os.cpu_count(),
        "load_average_per_round": loads,
        "load_average_after": [round(load, 2) for load in os.getloadavg()],
        "seconds": {name: [round(s, 2) for s in values] for name, values in times.items()},
        "ratio_2_vs_1_median": round(statistics.median(ratios), 3),
        "ratio_2_vs_1_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "work_seconds": {name: [round(s, 2) for s in values] for name, values in work.items()},
        "work_ratio_2_vs_1_median": round(statistics.median(work_ratios), 3),
        "work_ratio_2_vs_1_range": [round(min(work_ratios), 3), round(max(work_ratios), 3)],
        "rest_seconds_median": {name: round(statistics.median(values), 2) for name, values in rest.items()},
        "peak_rss_mb": round(peak),
    }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
