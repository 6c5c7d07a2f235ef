"""Checkpoints at large world sizes: `fsdpkit reshard` 2 -> W and `fsdpkit verify` of the result,
against `cp -r` + `sync` of that same result directory (same bytes, same number of files).

    .venv/bin/python benchmarks/checkpoint_scale.py                         # gpt2-medium + AdamW, W up to 16384
    .venv/bin/python benchmarks/checkpoint_scale.py --model gpt-small --world-sizes 4 64 --json

Makes one source checkpoint at --source-world-size ranks (format 2, the model's flat-parameter
placement, random weights and AdamW state: exp_avg, exp_avg_sq, step), or takes --source, then
for each W, --repeat times, each command in its own process, timed with a final `sync` included,
its input files first dropped from the page cache (`posix_fadvise(DONTNEED)`: clean pages of
those files only), so every command reads a checkpoint at rest from the disk, as the others do
(an input left cached by the command before would make one side's reads free):

- fsdpkit reshard SRC OUT --world-size W   (peak RSS: its VmHWM plus its worker process's)
- cp -r OUT COPY + sync                    (the baseline: the disk's and the filesystem's limit)
- fsdpkit verify OUT                       (every header and checksum)

and reports the median time of each, the median and range of the ratios to the copy of the
same round (the machine may be shared: only ratios measured side by side mean much), the
CPU seconds (user + sys) each spent per GB of checkpoint, the largest peak RSS and the
manifest's size. Targets: reshard <= 1.0x the copy up to W = 64 and <= 1.5x at 16384,
verify <= 1.0x, peak RSS <= 300 MB whatever W, manifest <= 1 MB. Free disk is checked first;
outputs are deleted once measured.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fsdpkit.sizes import format_size  # noqa: E402  (torch-free imports only here)

SETUP = r"""
import math, sys, torch
from pathlib import Path
from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import Manifest
from fsdpkit.checkpoint.format.placement import TensorSpec
from fsdpkit.checkpoint.live.save_protocol import write_rank
from fsdpkit.flat_layout import ElementRange
from fsdpkit.models.units import placement_for_model

run, model, world = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
placement = placement_for_model(model)
params = [(n, s) for unit in placement.units for n, s in unit]
table = [TensorSpec(n, "F32", s) for n, s in params]
table += [TensorSpec(f"optim.{k}.{n}", "F32", s) for k in ("exp_avg", "exp_avg_sq") for n, s in params]
table += [TensorSpec(f"optim.step.{n}", "F32", ()) for n, _ in params]


class Generated(dict):
    # each tensor made when first asked for, whole, so memory stays about one tensor
    def __missing__(self, name):
        self.clear()
        spec = next(t for t in table if t.name == name)
        g = torch.Generator().manual_seed(hash(name) % 2**31)
        data = torch.full((1,), 1000.0) if name.startswith("optim.step.") else torch.randn(max(spec.numel, 1), generator=g)[:spec.numel]
        self[name] = (ElementRange(0, spec.numel), data)
        return self[name]


manifest = Manifest(world, "full", placement, tuple(table), {}, {"step": 1000})
tmp = storage.begin(run, 1000)
for rank in range(world):
    write_rank(tmp, manifest, rank, Generated())
storage.commit(tmp, run, 1000, manifest)
print(sum(t.nbytes for t in table))
"""

# peak RSS printed last on stderr: the process's VmHWM plus the largest of its worker processes'
# (a reshard to many files forks one; their shared pages are counted twice)
PEAK = """
import resource, sys
try:
    from fsdpkit_cli.app import main
    main()
finally:
    status = open("/proc/self/status").read()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print("VmHWM", int(status.split("VmHWM:")[1].split()[0]) + children, file=sys.stderr)
"""


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def uncache(directory: Path) -> None:
    """Drop the (clean, synced) pages of the files under `directory` from the page cache."""
    for path in directory.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(command: list[str], reads: Path) -> dict:
    """Wall time of `command` plus a final `sync`, the CPU seconds (user + sys) of the command;
    its peak RSS when it reports one. Files under `reads` are dropped from the page cache first."""
    uncache(reads)
    start, cpu_start = time.perf_counter(), _children_cpu()
    proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    cpu = _children_cpu() - cpu_start
    subprocess.run(["sync"], check=True)
    seconds = time.perf_counter() - start
    lines = proc.stderr.strip().splitlines()
    peak = int(lines[-1].split()[1]) * 1024 if lines and lines[-1].startswith("VmHWM") else None
    if proc.returncode:
        raise SystemExit(f"error: {' '.join(command[:6])} ... failed: {lines[-2 if peak else -1] if lines else proc.returncode}")
    return {"seconds": seconds, "cpu": cpu, "peak_rss": peak}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1]}


def spread(ratio: dict) -> str:
    return f"{ratio['median']:.2f} [{ratio['min']:.2f}..{ratio['max']:.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-medium", help="model whose parameter shapes are used (fsdpkit registry)")
    parser.add_argument("--source-world-size", type=int, default=2)
    parser.add_argument("--source", type=Path, default=None, help="an existing sharded checkpoint to reshard instead")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per world size (reshard, cp -r, verify)")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[4, 64, 1024, 4096, 16384])
    parser.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)

    python = sys.executable
    fsdpkit = [python, "-c", PEAK]
    work = Path(tempfile.mkdtemp(prefix="fsdpkit-ckpt-scale-", dir=args.workdir))
    try:
        src = args.source or work / "src"
        if args.source is None:
            print(f"setting up {args.model} + AdamW state at W={args.source_world_size} in {work} ...", file=sys.stderr)
            setup = subprocess.run([python, "-c", SETUP, str(src), args.model, str(args.source_world_size)], capture_output=True, text=True)
            if setup.returncode:
                print(setup.stderr, file=sys.stderr)
                return 1
        data_bytes = sum(path.stat().st_size for path in Path(src).rglob("*.safetensors"))
        free = shutil.disk_usage(work).free
        if free < data_bytes * 2.2:
            print(f"error: needs about {format_size(int(data_bytes * 2.2))} free in {work}, {format_size(free)} free", file=sys.stderr)
            return 1
        subprocess.run(["sync"], check=True)
        rows = []
        for world in args.world_sizes:
            out, copy = work / "out", work / "copy"
            rounds = []
            for index in range(args.repeat):
                print(f"W={world} round {index + 1}/{args.repeat}: reshard, cp -r, verify ...", file=sys.stderr)
                reshard = timed(fsdpkit + ["reshard", str(src), str(out), "--world-size", str(world)], Path(src))
                cp = timed(["cp", "-r", str(out), str(copy)], out)
                shutil.rmtree(copy)
                subprocess.run(["sync"], check=True)
                verify = timed(fsdpkit + ["verify", str(out)], out)
                manifest_bytes = (out / "manifest.json").stat().st_size
                shutil.rmtree(out)
                subprocess.run(["sync"], check=True)
                rounds.append((reshard, cp, verify))
            rows.append(
                {
                    "world_size": world,
                    "files": world,
                    "reshard_s": summary([r["seconds"] for r, _, _ in rounds]),
                    "cp_s": summary([c["seconds"] for _, c, _ in rounds]),
                    "reshard_vs_cp": summary([r["seconds"] / c["seconds"] for r, c, _ in rounds]),
                    "reshard_peak_rss": max(r["peak_rss"] for r, _, _ in rounds),
                    "verify_s": summary([v["seconds"] for _, _, v in rounds]),
                    "verify_vs_cp": summary([v["seconds"] / c["seconds"] for _, c, v in rounds]),
                    "verify_peak_rss": max(v["peak_rss"] for _, _, v in rounds),
                    "manifest_bytes": manifest_bytes,
                    "cpu_s_per_gb": {
                        name: statistics.median(round_[i]["cpu"] for round_ in rounds) / (data_bytes / 1e9)
                        for i, name in enumerate(("reshard", "cp", "verify"))
                    },
                }
            )
        document = {
            "model": args.model,
            "source": str(args.source) if args.source else None,
            "bytes": data_bytes,
            "source_world_size": args.source_world_size,
            "repeat": args.repeat,
            "results": rows,
        }
        if args.json:
            print(json.dumps(document))
        else:
            print(
                f"# {format_size(data_bytes)} ({args.source or args.model}); reshard -> W, {args.repeat} rounds: "
                f"median seconds, ratio to cp -r of the same round as median [min..max]; inputs read from disk; times include a final sync"
            )
            print(
                f"{'W':>7}{'reshard s':>11}{'cp -r s':>9}{'reshard x cp':>20}{'peak RSS':>11}{'verify s':>10}"
                f"{'verify x cp':>20}{'verify RSS':>12}{'manifest':>11}{'CPU s/GB reshard cp verify':>28}"
            )
            for r in rows:
                print(
                    f"{r['world_size']:>7}{r['reshard_s']['median']:>11.2f}{r['cp_s']['median']:>9.2f}{spread(r['reshard_vs_cp']):>20}"
                    f"{format_size(r['reshard_peak_rss']):>11}{r['verify_s']['median']:>10.2f}{spread(r['verify_vs_cp']):>20}"
                    f"{format_size(r['verify_peak_rss']):>12}{format_size(r['manifest_bytes']):>11}"
                    f"{r['cpu_s_per_gb']['reshard']:>12.2f}{r['cpu_s_per_gb']['cp']:>8.2f}{r['cpu_s_per_gb']['verify']:>8.2f}"
                )
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
