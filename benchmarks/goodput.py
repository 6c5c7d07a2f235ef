"""Goodput with failures: `fsdpkit train` with a harness that SIGKILLs a random worker every T
seconds of training, with disk checkpoints only (a) and with in-memory snapshots as well (b),
side by side.

    python benchmarks/goodput.py --model gpt-small --steps 400 --periods 30,60 --json out.json
    python benchmarks/goodput.py --model gpt-tiny --steps 600 --periods 12 --kills 3   # a short look

Per mode and period: goodput (the failure-free run's time over the time with failures), the
failures, steps redone per failure, and recovery time (the failed attempt's last sign of life
to the next completed step) with its relaunch / rendezvous / restore split, from the run's own
`recoveries`. Also the snapshot overhead without failures: (b)'s failure-free training time
over (a)'s (the median over `--repeat` pairs, with its range), and how long a fresh launch
takes to its first step (the first line of its --metrics file). A period longer than the
run gets no kill; its goodput is then not a measurement (choose --steps so that a run
outlasts the longest period). The runs of one table alternate modes, so that load on the machine falls on
both alike. Last, each target is checked (`targets` in --json):

    snapshot overhead <= 3% of the failure-free training time;
    steps redone per failure <= --snapshot-every, with snapshots;
    recovery time <= a fresh launch to its first step + 1 s, with snapshots;
    goodput with snapshots >= 0.85 with a kill every 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean, median

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
DISK, SNAPSHOTS = "disk", "disk+snapshots"  # modes (a) and (b)


def workers(launcher: int) -> list[int]:
    """The launcher's worker processes: the children of its fork server."""
    found = []
    for pid in _children(launcher):
        command = _command_line(pid)
        if "multiprocessing.forkserver" in command:
            found += _children(pid)
        elif command and "resource_tracker" not in command:
            found.append(pid)
    return found


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()]
    except OSError:  # gone meanwhile
        return []


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def run(flags: list[str], *, period: float | None, seed: int, most: int) -> dict:
    """One training run, a random worker killed `period` seconds after its first step, and
    again `period` seconds after the first step of each restart (None: never), `most` times
    at most (a run that redoes more than it gains between kills would never end; a kill during
    a relaunch would count two failures as one); its summary with the wall time, the kills
    and the time from the launch to the first step added."""
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="goodput-") as directory:
        started = time.perf_counter()
        metrics = Path(directory) / "metrics.jsonl"
        process = subprocess.Popen(
            [FSDPKIT, "train", *flags, "--save-dir", "run", "--metrics", str(metrics), "--json", "--quiet"],
            cwd=directory,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        kills, first_step_s, size = 0, None, 0
        next_kill: float | None = None  # `period` after the first step, and after the first step of each restart
        while process.poll() is None:
            time.sleep(0.05)
            grew, size = _grown(metrics, size)
            if grew and next_kill is None:
                first_step_s = first_step_s or time.perf_counter() - started
                next_kill = time.perf_counter() + period if period and kills < most else None
            if next_kill is not None and time.perf_counter() >= next_kill:
                pids = workers(process.pid)
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    kills += 1
                next_kill = None  # until the restarted run completes a step
        out, err = process.communicate()
        wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"fsdpkit train failed ({process.returncode}): {err.decode()[-2000:]}")
    return {**json.loads(out), "wall_s": wall, "kills": kills, "first_step_s": first_step_s}


def _grown(metrics: Path, size: int) -> tuple[bool, int]:
    """Whether the --metrics file grew (a step completed; a restart cuts it back), and its size."""
    try:
        now = metrics.stat().st_size
    except OSError:
        return False, size
    return now > size, now


def row(mode: str, period: float | None, result: dict, clean_s: float) -> dict:
    recoveries = result["recoveries"]
    timed = [r for r in recoveries if r["recovery_s"] is not None]

    def average(key: str) -> float | None:
        return mean(r[key] for r in timed) if timed else None

    return {
        "mode": mode,
        "period_s": period,
        "wall_s": result["wall_s"],
        "first_step_s": result["first_step_s"],
        "goodput": clean_s / result["wall_s"],
        "kills": result["kills"],
        "failures": len(recoveries),
        "steps_redone_per_failure": mean(r["steps_redone"] for r in recoveries) if recoveries else 0.0,
        "sources": sorted({r["source"] for r in recoveries}),
        "recovery_s": average("recovery_s"),
        "relaunch_s": average("relaunch_s"),
        "rendezvous_s": average("rendezvous_s"),
        "restore_s": average("restore_s"),
    }


def targets(rows: list[dict], overhead: float, snapshot_every: int) -> list[dict]:
    """Each target of the table: what it asks, the value measured, and whether it is met
    (None: nothing measured it, such as no kill every 60 s, or a run that ended before the first kill)."""
    fresh = next(r["first_step_s"] for r in rows if r["mode"] == SNAPSHOTS and r["period_s"] is None)
    failing = [r for r in rows if r["mode"] == SNAPSHOTS and r["failures"]]
    redone = max((r["steps_redone_per_failure"] for r in failing), default=None)
    recovery = max((r["recovery_s"] for r in failing if r["recovery_s"] is not None), default=None)
    goodput = next((r["goodput"] for r in rows if r["mode"] == SNAPSHOTS and r["period_s"] == 60 and r["failures"]), None)

    def check(target: str, value: float | None, limit: float | None, at_most: bool) -> dict:
        met = None if value is None or limit is None else (value <= limit if at_most else value >= limit)
        return {"target": target, "value": value, "limit": limit, "met": met}

    return [
        check("snapshot overhead <= 3%", overhead, 0.03, True),
        check(f"steps redone per failure <= K = {snapshot_every}", redone, snapshot_every, True),
        check("recovery s <= fresh launch to first step + 1 s", recovery, None if fresh is None else fresh + 1.0, True),
        check("goodput at T = 60 s >= 0.85", goodput, 0.85, False),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-small")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--periods", default="30,60", help="seconds between kills, comma separated")
    parser.add_argument("--kills", type=int, default=5, help="kills per run at most")
    parser.add_argument("--repeat", type=int, default=1, help="failure-free runs of each mode, alternating (the overhead's median)")
    parser.add_argument("--json", dest="json_path", help="write the table here too")
    args = parser.parse_args()
    common = [
        "--model", args.model, "--steps", str(args.steps), "--nproc-per-node", str(args.nproc),
        "--seq-len", str(args.seq_len), "--global-batch-size", str(args.global_batch_size),
        "--save-every", str(args.save_every), "--max-restarts", str(args.kills),
    ]  # fmt: skip
    modes = {DISK: [*common, "--snapshot-every", "0"], SNAPSHOTS: [*common, "--snapshot-every", str(args.snapshot_every)]}
    repeats = [{mode: run(flags, period=None, seed=0, most=0) for mode, flags in modes.items()} for _ in range(args.repeat)]
    overheads = sorted(r[SNAPSHOTS]["elapsed_seconds"] / r[DISK]["elapsed_seconds"] - 1 for r in repeats)
    overhead = median(overheads)
    clean = {mode: min((r[mode] for r in repeats), key=lambda result: result["wall_s"]) for mode in modes}
    rows = [row(mode, None, clean[mode], clean[mode]["wall_s"]) for mode in modes]
    for period in (float(p) for p in args.periods.split(",")):
        for mode, flags in modes.items():
            rows.append(row(mode, period, run(flags, period=period, seed=int(period), most=args.kills), clean[mode]["wall_s"]))
    spread = f" (median of {len(overheads)}, range {overheads[0]:+.1%} to {overheads[-1]:+.1%})" if len(overheads) > 1 else ""
    print(f"snapshot overhead without failures: {overhead:+.1%} of the training time (every {args.snapshot_every} steps){spread}")
    fresh = ", ".join(f"{mode} {clean[mode]['first_step_s']:.1f} s" for mode in modes if clean[mode]["first_step_s"] is not None)
    print(f"a fresh launch to its first step: {fresh}")
    heading = f"{'mode':16} {'kill every':>10} {'goodput':>8} {'kills':>5} {'failures':>8} {'redone/fail':>11} {'recovery s':>10}"
    print(heading + "  split (relaunch/rendezvous/restore)")
    for r in rows:
        every = f"{r['period_s']:.0f} s" if r["period_s"] else "never"
        recovery = f"{r['recovery_s']:.1f}" if r["recovery_s"] is not None else "-"
        split = "/".join(f"{r[k]:.1f}" for k in ("relaunch_s", "rendezvous_s", "restore_s")) if r["recovery_s"] is not None else "-"
        redone = r["steps_redone_per_failure"]
        print(f"{r['mode']:16} {every:>10} {r['goodput']:8.2f} {r['kills']:5d} {r['failures']:8d} {redone:11.1f} {recovery:>10}  {split}")
    checked = targets(rows, overhead, args.snapshot_every)
    for t in checked:
        verdict = {True: "met", False: "NOT MET", None: "not measured"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        limit = "-" if t["limit"] is None else f"{t['limit']:.3g}"
        print(f"target {t['target']}: {value} (limit {limit}) {verdict}")
    if args.json_path:
        document = {"overhead": overhead, "overheads": overheads, "rows": rows, "targets": checked}
        Path(args.json_path).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
