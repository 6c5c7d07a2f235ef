"""`verify` of per-rank `torch.save` files (verl's layout: every storage checked against the zip's
CRC-32) with `--nproc-per-node 2` against one process, on this machine, side by side:

    .venv/bin/python benchmarks/spread_verify_speedup.py                 # 2 GiB in 2 files, 5 rounds
    .venv/bin/python benchmarks/spread_verify_speedup.py --gib 1 --rounds 3 --json

Makes the source once in a temporary directory (torch.save of random fp32 tensors of 64 MiB, two
rank files), reads it once so that every round finds it in the page cache, then, --rounds times,
runs each command in its own process in turn (the plain one-process verify, then
--nproc-per-node 2), its wall time including the start of its processes. Reports the median and
range of the per-round ratios of 2 processes to 1 and the load average at the start of each round:
on a shared machine only ratios measured side by side mean much, and their spread says how much.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TENSOR_MIB = 64


def make_source(root: Path, gib: float) -> Path:
    import torch

    generator = torch.Generator().manual_seed(0)
    per_file = max(1, int(gib * 1024 / TENSOR_MIB / 2))
    source = root / "verl"
    source.mkdir()
    for rank in range(2):
        tensors = {f"layer.{i}.weight": torch.randn(TENSOR_MIB << 18, generator=generator) for i in range(per_file)}
        torch.save(tensors, source / f"model_world_size_2_rank_{rank}.pt")
    for path in source.iterdir():  # into the page cache
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass
    return source


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spread-verify-"))
    try:
        source = make_source(root, args.gib)
        base = [sys.executable, "-m", "fsdpkit_cli", "verify", str(source)]
        rounds = []
        for _ in range(args.rounds):
            load = os.getloadavg()[0]
            one, two = timed(base), timed([*base, "--nproc-per-node", "2"])
            rounds.append({"load": load, "one": one, "two": two, "ratio": two / one})
    finally:
        shutil.rmtree(root)
    ratios = [r["ratio"] for r in rounds]
    summary = {"gib": args.gib, "rounds": rounds, "median_ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    if args.json:
        print(json.dumps(summary))
        return
    for number, r in enumerate(rounds, 1):
        print(f"round {number}: load {r['load']:.1f}, 1 process {r['one']:.2f} s, 2 processes {r['two']:.2f} s, {r['ratio']:.2f}x")
    print(f"2 vs 1: median {summary['median_ratio']:.2f}x (range {min(ratios):.2f}-{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
