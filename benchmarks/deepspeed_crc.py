"""`convert --to deepspeed` of a ~1 GB model by this checkout against another one (`--baseline`,
its PYTHONPATH), side by side on this machine: what writing every storage's CRC-32 costs.

    .venv/bin/python benchmarks/deepspeed_crc.py --baseline /path/to/other/checkout
    .venv/bin/python benchmarks/deepspeed_crc.py --baseline /path/to/other/checkout --tensors 4 --rounds 3 --json

The source is made once in a temporary directory: `--tensors` fp32 weights of 4096 x 1024 (16
of them: 67M parameters, ~1.07 GB of DeepSpeed output: fp32 weights, master weights and Adam's
two moments) with random values and Adam's two moments, written as full safetensors by numpy.
Then, after one run of each not counted (the source into the page cache), `--rounds` times,
`convert SRC OUT --to deepspeed --stage 2 --world-size 2` of each checkout runs in its own
process, their order alternating from round to round, each into a new directory removed
afterwards. Reported: the median and range of the wall time and CPU seconds of each, and of the
per-round ratio this / baseline, with the load average at each round's start (a loaded machine
blurs the times; the ratio of runs side by side blurs less).
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

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (4096, 1024)


def pythonpath(checkout: Path) -> str:
    """A checkout's PYTHONPATH: its root, and its `.shim` (a worktree's fsdpkit_cli) when it has one."""
    shim = checkout / ".shim"
    return f"{checkout}:{shim}" if shim.is_dir() else str(checkout)


def make_source(directory: Path, count: int) -> int:
    """Full safetensors with Adam's moments in `directory`; returns the parameter count."""
    from safetensors.numpy import save_file

    rng = numpy.random.default_rng(0)
    weight_map = {}
    for index in range(count):
        name = f"layer.{index}.weight"
        weight = rng.standard_normal(SHAPE, dtype=numpy.float32)
        moment = numpy.abs(weight) * numpy.float32(1e-3)
        tensors = {name: weight, f"optim.exp_avg.{name}": moment, f"optim.exp_avg_sq.{name}": moment * moment}
        file = f"part{index:03d}.safetensors"
        save_file(tensors, directory / file)
        weight_map |= dict.fromkeys(tensors, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return count * SHAPE[0] * SHAPE[1]


def timed(checkout: Path, source: Path, out: Path) -> dict[str, float]:
    """One `convert --to deepspeed` by `checkout`: its wall time and CPU seconds; `out` removed after."""
    env = {**os.environ, "PYTHONPATH": pythonpath(checkout), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fsdpkit_cli", "convert", str(source), str(out), "--to", "deepspeed", "--stage", "2"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    subprocess.run([*command, "--world-size", "2"], check=True, env=env, cwd=tempfile.gettempdir(), **quiet)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    written = sum(path.stat().st_size for path in out.rglob("*") if path.is_file())
    shutil.rmtree(out)
    return {"wall": wall, "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, "bytes": written}


def spread_of(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="The other checkout (its root; its .shim too when it has one).")
    parser.add_argument("--tensors", type=int, default=16, help="Weights of 4096 x 1024 (16: ~1.07 GB of output).")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="Print one JSON document instead of lines.")
    args = parser.parse_args(argv)
    checkouts = {"this": ROOT, "baseline": args.baseline.resolve()}
    with tempfile.TemporaryDirectory(prefix="fsdpkit-deepspeed-crc-") as scratch:
        work = Path(scratch)
        (work / "src").mkdir()
        parameters = make_source(work / "src", args.tensors)
        for checkout in checkouts.values():  # not counted: the source into the page cache
            timed(checkout, work / "src", work / "out")
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in checkouts}
        loads = []
        for round_number in range(args.rounds):
            loads.append(os.getloadavg()[0])
            order = list(checkouts) if round_number % 2 == 0 else list(reversed(checkouts))
            for name in order:
                runs[name].append(timed(checkouts[name], work / "src", work / "out"))
    document = {
        "parameters": parameters,
        "output_bytes": runs["this"][0]["bytes"],
        "rounds": args.rounds,
        "load_average": spread_of(loads),
        **{f"{name}_{what}": spread_of([run[what] for run in runs[name]]) for name in checkouts for what in ("wall", "cpu")},
        **{
            f"ratio_{what}": spread_of([t[what] / b[what] for t, b in zip(runs["this"], runs["baseline"], strict=True)])
            for what in ("wall", "cpu")
        },
    }
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    written = document["output_bytes"] / 1e9
    print(f"convert --to deepspeed --stage 2 --world-size 2: {parameters / 1e6:.0f}M parameters, {written:.2f} GB written")
    print(f"{args.rounds} rounds, load average at their start {loads}")
    for name in checkouts:
        wall, cpu = document[f"{name}_wall"], document[f"{name}_cpu"]
        print(f"{name:>8}: wall {wall['median']:.2f} s [{wall['min']:.2f}, {wall['max']:.2f}], ", end="")
        print(f"cpu {cpu['median']:.2f} s [{cpu['min']:.2f}, {cpu['max']:.2f}]")
    for what in ("wall", "cpu"):
        ratio = document[f"ratio_{what}"]
        print(f"this / baseline {what} per round: {ratio['median']:.2f}x [{ratio['min']:.2f}, {ratio['max']:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
