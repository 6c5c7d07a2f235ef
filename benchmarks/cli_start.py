"""Start-up time of `fsdpkit` commands: wall time of each command as its own process, on a tiny
DCP checkpoint, and `convert --to full` of a tiny Megatron one (so the time is Python's start,
the CLI's imports and parsing, and little work), side by side with another checkout's in the
same rounds, alternating. Each run's CPU time (user + system) is reported beside its wall time:
on a loaded machine it moves less than the wall time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cli_start.py --repeat 21 --baseline ''
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/cli_start.py --repeat 21 --baseline /other/checkout:/other/checkout/.shim

`--baseline PYTHONPATH` times the same commands with that PYTHONPATH ('': unset, the installed
fsdpkit); this process's PYTHONPATH gives the checkout under test. Reported: median and range of
each command's wall and CPU seconds over `--repeat` rounds, and per round the ratio of this
checkout's to the baseline's (median and range); `--json` prints them as one document.
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

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
MEGATRON = Path(__file__).resolve().parents[1] / "tests/fixtures/megatron/mcore_0_19_torch_dist/checkpoint"


def write_dcp(directory: Path) -> None:
    """A DCP checkpoint of two small tensors, written by torch's own `dcp.save` in a child."""
    script = (
        "import sys, warnings, torch, torch.distributed.checkpoint as dcp\n"
        "warnings.simplefilter('ignore')\n"
        "dcp.save({'model': {'w': torch.ones(4, 4), 'b': torch.zeros(4)}}, checkpoint_id=sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(directory)], check=True, capture_output=True)


def commands(checkpoint: Path) -> dict[str, list[str]]:
    """The timed commands: `checkpoint` is the tiny DCP one; convert's source is a committed
    Megatron test fixture (Llama-style, as `megatron_interop.py`'s), its output beside `checkpoint`."""
    converted = [str(MEGATRON), str(checkpoint.with_name("hf")), "--to", "full", "--overwrite"]
    return {
        "inspect": [FSDPKIT, "inspect", str(checkpoint)],
        "verify": [FSDPKIT, "verify", str(checkpoint)],
        "convert": [FSDPKIT, "convert", *converted],
        "--help": [FSDPKIT, "--help"],
    }


def timed(command: list[str], pythonpath: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of one run of `command` with PYTHONPATH `pythonpath` (None: this process's; '': unset)."""
    environment = dict(os.environ)
    if pythonpath is not None:
        environment.pop("PYTHONPATH", None)
        if pythonpath:
            environment["PYTHONPATH"] = pythonpath
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


Runs = dict[str, dict[str, list[tuple[float, float]]]]


def rounds(checkpoint: Path, repeat: int, baseline: str | None) -> Runs:
    """Per command, the (wall, CPU) seconds of each round under test ('this') and, with a baseline, its ('baseline')."""
    checkouts = {"this": None} | ({"baseline": baseline} if baseline is not None else {})
    runs = [(name, checkout) for name in commands(checkpoint) for checkout in checkouts]
    seconds: Runs = {name: {checkout: [] for checkout in checkouts} for name in commands(checkpoint)}
    for name, checkout in runs:  # each once, unmeasured: bytecode cached, files in the page cache
        timed(commands(checkpoint)[name], checkouts[checkout])
    for round_ in range(repeat):
        turn = round_ % len(runs)
        for name, checkout in runs[turn:] + runs[:turn]:
            seconds[name][checkout].append(timed(commands(checkpoint)[name], checkouts[checkout]))
    return seconds


def figures(seconds: Runs) -> dict:
    """Per command, wall and CPU: each checkout's median and range, and the per-round ratio's."""
    document: dict = {}
    for name, found in seconds.items():
        for kind, index in (("wall", 0), ("cpu", 1)):
            shown = {checkout: summary([run[index] for run in runs]) for checkout, runs in found.items()}
            if "baseline" in found:
                shown["this_over_baseline"] = summary([t[index] / b[index] for t, b in zip(found["this"], found["baseline"], strict=True)])
            document.setdefault(name, {})[kind] = shown
    return document


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline", metavar="PYTHONPATH", help="also time the commands with this PYTHONPATH ('': unset) in the same rounds"
    )
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cli-start-"))
    # bytecode cached, as an installed package's is: with PYTHONDONTWRITEBYTECODE set every run would compile fsdpkit again
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(work / "bytecode")
    try:
        write_dcp(work / "dcp")
        seconds = rounds(work / "dcp", args.repeat, args.baseline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    document = {"load_average": os.getloadavg(), "rounds": args.repeat, "commands": figures(seconds)}
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(f"load average {' '.join(f'{load:.2f}' for load in document['load_average'])}; {args.repeat} rounds")
    for name, kinds in document["commands"].items():
        for kind, found in kinds.items():
            line = f"fsdpkit {name:8} {kind:4}" + "".join(
                f"  {checkout} {s['median']:.3f} s [{s['min']:.3f}, {s['max']:.3f}]"
                for checkout, s in found.items()
                if checkout != "this_over_baseline"
            )
            if "this_over_baseline" in found:
                r = found["this_over_baseline"]
                line += f"  this/baseline {r['median']:.2f}x [{r['min']:.2f}, {r['max']:.2f}]"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
