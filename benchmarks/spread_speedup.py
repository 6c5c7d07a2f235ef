"""A CPU-bound conversion spread over 2 processes against 1, on this machine, side by side. Two
workloads: `--workload hf-bf16` (the default), DeepSpeed ZeRO-3 (fp32 weights and Adam) of a
gpt2-large-sized model -> Hugging Face bf16 in files of `--max-shard-size` (every weight read,
cast to bf16 and checksummed); `--workload sharded64`, the model's full fp32 safetensors (one file
per block, weights only) -> fsdpkit's sharded format at `--world-size 64` (every weight read and
checksummed, written as 64 ranks' fragments, each fragment checksummed):

    .venv/bin/python benchmarks/spread_speedup.py                   # gpt2-large: 36 layers, 3.1 GB fp32, 5 rounds
    .venv/bin/python benchmarks/spread_speedup.py --layers 6 --rounds 3 --json
    .venv/bin/python benchmarks/spread_speedup.py --workload sharded64

Every run's output is compared byte for byte, file by file, with that of the first run of 1
process (the warm-up's, kept as the reference) and removed right after
(`outputs_differing_from_1_process` lists what differs: empty when they are identical): a round
leaves no output in the page cache for the next run to reclaim (keeping a round's 4 outputs of
1.5 GB beside the 9.3 GB source, with `--baseline`, made the round's last run 1.5-2x slower,
whichever it was).

The source is made once in a temporary directory, by a process of its own (a child's peak RSS
would start from this process's): GPT-2's tensor shapes (n_embd 1280, vocab 50257,
1024 positions, `--layers` blocks) with random fp32 weights and Adam's two moments, written as full
safetensors by numpy (one file per block; sharded64's source, without the moments) and, for
hf-bf16, converted by fsdpkit `--to deepspeed --stage 3
--world-size 4` (DeepSpeed's own layout: `zero_pp_rank_*_mp_rank_00_{model,optim}_states.pt`,
the fp32 weights in each rank's flat group; DeepSpeed's `zero_to_fp32` reads it, a test checks).
Then, after one run of each not counted (the weights into the page cache, fsdpkit's modules
compiled), `--rounds` times, `--nproc-per-node 1` and `2` each run in its own process, their order
alternating from round to round, each into a new directory removed afterwards. Every run imports
fsdpkit from bytecode compiled once into the temporary directory ($PYTHONPYCACHEPREFIX there), as
an installed fsdpkit does; `--compile-every-run` has every process compile it from source again
(as with PYTHONDONTWRITEBYTECODE=1 and no __pycache__: about 0.2 s more start in each process).
`--source-dir DIR` keeps the source in DIR (made there once, used as it is by later runs with the
same `--layers`).

Reported (medians, and the spread of the per-round ratios of 2 processes to 1): the wall time; the
slowest rank's own work; each rank's phases from its `--json` marks (on the machine's monotonic
clock, from the moment the command was started): start (the interpreter, imports, starting the
workers), open (the source's metadata), plan (rank 0: planning and the staging area; a worker:
waiting for the plan), work (its parts), wait (for the other ranks' reports), commit (rank 0), exit;
the peak RSS of each process; and the load average at each round's start. And what a loaded
machine blurs less: the CPU seconds of the whole command (all its processes), and of its busiest
rank until its parts were done (each rank's start, opening, planning and work: on two idle cores,
the two ranks' run side by side, so the ratio of the busiest rank's to one process's is about
what the wall time's would be there); and the time until the last rank's parts were done, less
the time that rank's main thread waited for a core (`run_delay_seconds`, Linux's schedstat): what
a loaded machine adds to it taken out, its waits for the disk (fsync) kept in.
"""

from __future__ import annotations

import argparse
import filecmp
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
from typing import NamedTuple

import numpy

EMBD, VOCAB, POSITIONS = 1280, 50257, 1024
SOURCE_RANKS = "4"  # the DeepSpeed run's ranks
PHASES = (("start", None, "begun"), ("open", "begun", "opened"), ("plan", "opened", "planned"), ("work", "working", "worked"))
PHASES += (("wait", "worked", "gathered"), ("commit", "gathered", "committed"))


class Workload(NamedTuple):
    source: str  # the source's directory name
    flags: tuple[str, ...]  # convert's, after SRC DST; {max_shard_size} filled in


WORKLOADS = {
    "hf-bf16": Workload("deepspeed", ("--to", "full", "--dtype", "bf16", "--max-shard-size", "{max_shard_size}")),
    "sharded64": Workload("hf-fp32", ("--to", "sharded", "--world-size", "64")),
}


def block_shapes(index: int) -> dict[str, tuple[int, ...]]:
    h = f"h.{index}."
    shapes = {h + "ln_1.weight": (EMBD,), h + "ln_1.bias": (EMBD,), h + "attn.c_attn.weight": (EMBD, 3 * EMBD)}
    shapes |= {h + "attn.c_attn.bias": (3 * EMBD,), h + "attn.c_proj.weight": (EMBD, EMBD), h + "attn.c_proj.bias": (EMBD,)}
    shapes |= {h + "ln_2.weight": (EMBD,), h + "ln_2.bias": (EMBD,), h + "mlp.c_fc.weight": (EMBD, 4 * EMBD)}
    return shapes | {h + "mlp.c_fc.bias": (4 * EMBD,), h + "mlp.c_proj.weight": (4 * EMBD, EMBD), h + "mlp.c_proj.bias": (EMBD,)}


def write_full(directory: Path, layers: int, *, with_moments: bool) -> int:
    """GPT-2's shapes with random fp32 weights (and Adam's two moments) as full safetensors, one file
    per block, with model.safetensors.index.json; returns the fp32 weight bytes."""
    from safetensors.numpy import save_file

    rng = numpy.random.default_rng(0)
    groups = [{"wte.weight": (VOCAB, EMBD), "wpe.weight": (POSITIONS, EMBD), "ln_f.weight": (EMBD,), "ln_f.bias": (EMBD,)}]
    groups += [block_shapes(index) for index in range(layers)]
    weight_map, weight_bytes = {}, 0
    directory.mkdir()
    for number, shapes in enumerate(groups):
        tensors = {}
        for name, shape in shapes.items():
            weight = rng.standard_normal(shape, dtype=numpy.float32)
            tensors[name] = weight
            if with_moments:
                moment = numpy.abs(weight) * numpy.float32(1e-3)
                tensors |= {f"optim.exp_avg.{name}": moment, f"optim.exp_avg_sq.{name}": moment * moment}
            weight_bytes += weight.nbytes
        file = f"part{number:03d}.safetensors"
        save_file(tensors, directory / file)
        weight_map |= dict.fromkeys(tensors, file)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_bytes


def make_source(root: Path, layers: int, workload: str = "hf-bf16") -> tuple[Path, int]:
    """`workload`'s source in `root`: (it, its fp32 weight bytes). hf-bf16's is a DeepSpeed ZeRO-3
    checkpoint of SOURCE_RANKS ranks (weights and Adam's moments); sharded64's the full fp32 weights."""
    source = root / WORKLOADS[workload].source
    if workload == "sharded64":
        return source, write_full(source, layers, with_moments=False)
    full = root / "full"
    weight_bytes = write_full(full, layers, with_moments=True)
    command = [sys.executable, "-m", "fsdpkit_cli", "convert", str(full), str(source), "--to", "deepspeed", "--stage", "3"]
    subprocess.run([*command, "--world-size", SOURCE_RANKS], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(full)
    return source, weight_bytes


def weight_bytes_of(layers: int) -> int:
    """The fp32 weight bytes of the source `make_source` makes."""
    shapes = [(VOCAB, EMBD), (POSITIONS, EMBD), (EMBD,), (EMBD,), *(s for i in range(layers) for s in block_shapes(i).values())]
    return 4 * sum(int(numpy.prod(shape)) for shape in shapes)


def bytecode_env(env: dict[str, str], cache: Path, *, compile_every_run: bool) -> dict[str, str]:
    """`env` with fsdpkit imported from bytecode kept in `cache` (or compiled from source each time)."""
    if compile_every_run:
        return env | {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(cache / "never-written")}
    return {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPYCACHEPREFIX": str(cache)}


def timed(command: list[str], env: dict[str, str] | None = None) -> dict:
    """One run: its wall time, and per rank its phases (seconds) and peak RSS (MB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(
        [*command, "--json"], check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=tempfile.gettempdir()
    )  # not this tree: `-m` puts the working directory first on sys.path
    ended = time.monotonic()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the command's process and its workers (it waits for them)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    ranks = []
    for rank in json.loads(done.stdout)["spread"]["ranks"]:
        marks = {"launched": started, **rank.get("marks", {})}  # a baseline's fsdpkit may report no marks
        phases = {name: marks[end] - marks[begin or "launched"] for name, begin, end in PHASES if end in marks}
        if "committed" in marks:
            phases["exit"] = ended - marks["committed"]
        peak_rss_mb = round(rank.get("peak_rss_bytes", 0) / 2**20, 1)  # VmHWM (a baseline's fsdpkit may report none)
        done = marks.get("worked", started) - started - rank.get("run_delay_seconds", 0.0)  # a baseline's may report no delay
        helpers = rank.get("cpu_seconds", 0) - rank.get(
            "main_thread_cpu_seconds", rank.get("cpu_seconds", 0)
        )  # a baseline's may report none
        ranks.append(
            {"phases": phases, "peak_rss_mb": peak_rss_mb, "work": rank["seconds"], "cpu": rank.get("cpu_seconds", 0), "done": done}
            | {"helper_cpu": helpers}
        )
    slowest = max(rank["cpu"] for rank in ranks)
    done = max(rank["done"] for rank in ranks)  # the last rank's parts done, less its waits for a core
    figures = {"wall": ended - started, "work": max(rank["work"] for rank in ranks), "cpu": cpu, "slowest_rank_cpu": slowest}
    figures["helper_cpu"] = sum(rank["helper_cpu"] for rank in ranks)
    return figures | {"done_less_core_waits": done, "ranks": ranks}


def tree_differences(one: Path, other: Path) -> list[str]:
    """The files (relative paths) that are in one tree and not the other, or whose bytes differ."""
    files = [{path.relative_to(root) for path in root.rglob("*") if path.is_file()} for root in (one, other)]
    differing = files[0] ^ files[1]
    for path in files[0] & files[1]:
        if not filecmp.cmp(one / path, other / path, shallow=False):
            differing.add(path)
    return sorted(str(path) for path in differing)


def spread_of(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def summary(runs: dict[str, list[dict]], loads: list[float], weight_bytes: int) -> dict:
    result: dict = {"fp32_weight_gb": round(weight_bytes / 1e9, 2), "rounds": len(runs["1"]), "cpus": os.cpu_count()}
    result["load_average_per_round"] = loads
    result["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    pairs = [("2", "1"), *((("2 baseline", "1 baseline"), ("2", "2 baseline")) if "1 baseline" in runs else ())]
    for key in ("wall", "work", "cpu", "slowest_rank_cpu", "done_less_core_waits", "helper_cpu"):
        result[f"{key}_seconds"] = {n: [round(run[key], 2) for run in runs[n]] for n in runs}
        for two, one in pairs:
            ratios = [b[key] / a[key] if a[key] else float("nan") for a, b in zip(runs[one], runs[two], strict=True)]
            result[f"{key}_ratio_{two.replace(' ', '_')}_vs_{one.replace(' ', '_')}"] = spread_of(ratios)
    result["phases_median_seconds"] = {
        f"{n} processes, rank {rank}": {
            phase: round(statistics.median(run["ranks"][rank]["phases"].get(phase, 0.0) for run in runs[n]), 3)
            for phase in ("start", "open", "plan", "work", "wait", "commit", "exit")
            if phase in runs[n][0]["ranks"][rank]["phases"]
        }
        for n in runs
        for rank in range(int(n[0]))
    }
    result["peak_rss_mb_max"] = {
        f"{n} processes, rank {rank}": max(run["ranks"][rank]["peak_rss_mb"] for run in runs[n]) for n in runs for rank in range(int(n[0]))
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=36, help="GPT-2 blocks: 36 is gpt2-large (774M parameters), 24 gpt2-medium")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="hf-bf16",
        help="hf-bf16: DeepSpeed ZeRO-3 -> full bf16; sharded64: full fp32 -> sharded W=64",
    )
    parser.add_argument("--max-shard-size", default="200MB", help="hf-bf16's output files")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline", metavar="PYTHONPATH", help="also run both with this PYTHONPATH ('' for the installed fsdpkit), in the same rounds"
    )
    parser.add_argument("--compile-every-run", action="store_true", help="every process compiles fsdpkit from source (no bytecode kept)")
    parser.add_argument("--source-dir", type=Path, help="keep the source here (made once; later runs with the same --layers use it)")
    parser.add_argument(
        "--output-dir", type=Path, help="write the outputs here (say /dev/shm: no disk, no writeback) rather than beside the source"
    )
    parser.add_argument("--make-source-in", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_source_in is not None:
        print(make_source(args.make_source_in, args.layers, args.workload)[1])
        return 0
    with tempfile.TemporaryDirectory(prefix="fsdpkit-spread-", dir=os.environ.get("TMPDIR")) as tmp:
        where = args.source_dir or Path(tmp)
        workload = WORKLOADS[args.workload]
        source, weight_bytes = where / workload.source, weight_bytes_of(args.layers)
        if not source.is_dir():
            where.mkdir(parents=True, exist_ok=True)
            made = [
                sys.executable,
                __file__,
                "--layers",
                str(args.layers),
                "--workload",
                args.workload,
                "--make-source-in",
                str(where),
            ]  # apart: this process stays small
            subprocess.run(made, check=True, stdout=subprocess.DEVNULL)
        base = [sys.executable, "-m", "fsdpkit_cli", "convert", str(source)]
        flags = [flag.format(max_shard_size=args.max_shard_size) for flag in workload.flags]
        env = bytecode_env(dict(os.environ), Path(tmp) / "pycache", compile_every_run=args.compile_every_run)
        variants: dict[str, dict[str, str]] = {"1": env, "2": env}
        if args.baseline is not None:
            old = {k: v for k, v in env.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": args.baseline} if args.baseline else {})
            variants |= {"1 baseline": old, "2 baseline": old}
        outputs = Path(tempfile.mkdtemp(prefix="fsdpkit-spread-out-", dir=args.output_dir)) if args.output_dir else Path(tmp)
        try:
            runs, loads, differing = run_rounds(args, base, flags, variants, outputs)
        finally:
            if outputs != Path(tmp):
                shutil.rmtree(outputs, ignore_errors=True)
    document = summary(runs, loads, weight_bytes) | {"workload": args.workload, "outputs_differing_from_1_process": differing}
    document["fsdpkit_from"] = "source, every run" if args.compile_every_run else "bytecode"
    document["outputs_in"] = str(args.output_dir or "the source's temporary directory")
    print(json.dumps(document, indent=None if args.json else 2))
    return 0


def run_rounds(args: argparse.Namespace, base: list[str], flags: list[str], variants: dict[str, dict[str, str]], tmp: Path):
    """The warm-up, then `args.rounds` rounds of every variant, outputs in `tmp`: (runs, load per round, differences)."""
    reference = Path(tmp) / "reference"
    for name in variants:  # the weights into the page cache, the modules compiled; 1 process's output the reference
        out = reference if name == "1" else Path(tmp) / "warm-up"
        timed([*base, str(out), *flags, "--nproc-per-node", name[0]], variants[name])
        if out != reference:
            shutil.rmtree(out)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    loads, differing = [], []
    for round_number in range(args.rounds):
        loads.append(round(os.getloadavg()[0], 2))
        for name in list(variants) if round_number % 2 == 0 else list(variants)[::-1]:
            out = Path(tmp) / f"out-{name.replace(' ', '-')}-{round_number}"
            runs[name].append(timed([*base, str(out), *flags, "--nproc-per-node", name[0]], variants[name]))
            differing += [f"round {round_number}, {name}: {path}" for path in tree_differences(reference, out)]
            shutil.rmtree(out)
    shutil.rmtree(reference)
    return runs, loads, differing


if __name__ == "__main__":
    raise SystemExit(main())
