"""What saving checkpoints costs training: `fsdpkit train` without saving, with synchronous saves
and with `--async-save`, and torch FSDP2 without saving and with torch DCP's `async_save` (thread
and process executors), side by side, alternating; tokens/s as ratios to the same system's run
without saving, and the training thread's stall per save.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/save_overhead.py --repeat 5
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/save_overhead.py --modes "no save,async,fsdp2,dcp thread,dcp process"

Each round runs every mode once (the order rotates from round to round), each as its own
process tree: `fsdpkit train --json`, or benchmarks/dcp_saves.py for FSDP2 + DCP (the same
model, units, AdamW and synthetic batches). By default the built-in gpt2 (124M) at 2 ranks on
CPU, 12 steps of 2 x 128 tokens, saving model and AdamW state every 2 steps (keeping the last
checkpoint, in a temporary directory removed afterwards). A run's tokens/s counts what a step
costs the training thread, saves included: tokens over the steps after the first, divided by
those steps' time (the summary's `step_tokens_per_second`) plus `save_stall_s` (the time the
training thread spent in saves between steps: the snapshot and waiting for the previous save
when async, all of it when synchronous; the save after the last step is not counted). The
stall per save divides it by the saves counted. The ratios to the run without saving, per
round, are reported as median and range over `--repeat` rounds.

For the synchronous saves, `save_timings` (rank 0, summed over its saves) splits the save time
into snapshot copy, crc32 checksum, write, fsync, and the rest (collectives, manifest, commit).
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
from pathlib import Path

FSDPKIT = str(Path(sys.executable).with_name("fsdpkit"))
DCP_SAVES = str(Path(__file__).with_name("dcp_saves.py"))
FSDPKIT_MODES = {"no save": [], "sync": ["--save-every", "{every}"], "async": ["--save-every", "{every}", "--async-save"]}
DCP_MODES = {"fsdp2": "none", "dcp thread": "thread", "dcp process": "process"}
BASELINE = {**dict.fromkeys(FSDPKIT_MODES, "no save"), **dict.fromkeys(DCP_MODES, "fsdp2")}
PARTS = ("snapshot", "checksum", "write", "fsync")


def command_of(mode: str, args: argparse.Namespace, save_dir: Path) -> list[str]:
    """The command line of one run of `mode`."""
    shape = [
        "--model",
        args.model,
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
    ]
    if mode in DCP_MODES:
        return [
            sys.executable,
            DCP_SAVES,
            "--mode",
            DCP_MODES[mode],
            *shape,
            "--batch",
            str(args.batch),
            "--save-every",
            str(args.save_every),
            "--save-dir",
            str(save_dir),
        ]
    flags = [f.format(every=args.save_every) for f in FSDPKIT_MODES[mode]]
    if flags:
        flags += ["--save-dir", str(save_dir), "--keep-last", "1"]
    return [FSDPKIT, "train", *shape, "--global-batch-size", str(args.batch), "--quiet", "--json", *flags]


def run_once(mode: str, args: argparse.Namespace, work: Path) -> dict:
    """One run of `mode`; its summary."""
    save_dir = work / mode.replace(" ", "-")
    command = command_of(mode, args, save_dir)
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    )
    shutil.rmtree(save_dir, ignore_errors=True)
    if done.returncode != 0:
        sys.exit(f"{mode}: {' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(done.stdout)


def tokens_per_second(summary: dict) -> float:
    """Tokens over the steps after the first, per second of those steps plus the save stall."""
    tokens = summary["global_batch_size"] * summary["seq_len"] * (summary["steps"] - 1)
    return tokens / (tokens / summary["step_tokens_per_second"] + summary["save_stall_s"])


def shares(timings: dict) -> dict[str, float]:
    """Each part's share of the save time, and the rest."""
    total = timings["total"]
    parts = {part: timings[part] / total for part in PARTS}
    parts["other"] = 1.0 - sum(parts.values())
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="global batch size (sequences)")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3, help="rounds; each runs every mode once")
    parser.add_argument("--modes", default=",".join([*FSDPKIT_MODES, *DCP_MODES]), help="comma-separated, from: %(default)s")
    parser.add_argument("--work-dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = parser.parse_args()
    modes = [mode.strip() for mode in args.modes.split(",")]
    unknown = [mode for mode in modes if mode not in BASELINE]
    missing = {BASELINE[mode] for mode in modes} - set(modes)
    if unknown or missing:
        parser.error(f"--modes: unknown {unknown}, baselines to add {sorted(missing)}")
    work = Path(tempfile.mkdtemp(prefix="save-overhead-", dir=args.work_dir))
    rounds = []
    try:
        for index in range(args.repeat):
            order = modes[index % len(modes) :] + modes[: index % len(modes)]
            summaries = {mode: run_once(mode, args, work) for mode in order}
            rounds.append(summaries)
            print(
                f"round {index + 1}/{args.repeat}: "
                + ", ".join(f"{mode} {tokens_per_second(summaries[mode]):,.0f} tokens/s" for mode in order),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = summarize(args, modes, rounds)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print_table(args, result)


def summarize(args: argparse.Namespace, modes: list[str], rounds: list[dict[str, dict]]) -> dict:
    """Per mode: tokens/s, ratio to its system's run without saving and stall per save (median, range over rounds)."""
    result: dict = {"settings": {k: v for k, v in vars(args).items() if k not in ("json", "work_dir")}, "modes": {}}
    counted_saves = (args.steps - 1) // args.save_every  # the save after the last step is not counted
    for mode in modes:
        rates = [tokens_per_second(summaries[mode]) for summaries in rounds]
        ratios = [rate / tokens_per_second(summaries[BASELINE[mode]]) for rate, summaries in zip(rates, rounds, strict=True)]
        stalls = [s[mode]["save_stall_s"] / counted_saves if mode != BASELINE[mode] else 0.0 for s in rounds]
        entry = {
            "tokens_per_second": statistics.median(rates),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "save_stall_s": statistics.median(s[mode]["save_stall_s"] for s in rounds),
            "stall_per_save_median": statistics.median(stalls),
            "stall_per_save_min": min(stalls),
            "stall_per_save_max": max(stalls),
        }
        timings = rounds[-1][mode].get("save_timings")
        if timings and timings["saves"]:
            entry["saves"] = timings["saves"]
            entry["save_seconds"] = statistics.median(s[mode]["save_timings"]["total"] for s in rounds)
            entry["save_shares"] = {
                part: statistics.median(shares(s[mode]["save_timings"])[part] for s in rounds) for part in (*PARTS, "other")
            }
        result["modes"][mode] = entry
    result["counted_saves"] = counted_saves
    return result


def print_table(args: argparse.Namespace, result: dict) -> None:
    counted_saves = result["counted_saves"]
    print(
        f"# {args.model}, {args.nproc_per_node} ranks, {args.steps} steps of {args.batch} x {args.seq_len} tokens, "
        f"saving every {args.save_every}; {args.repeat} rounds (median, range)"
    )
    print(f"  {'mode':<12} {'tokens/s':>10} {'ratio':>7} {'range':>13} {'stall/save s':>13} {'range':>13}")
    for mode, entry in result["modes"].items():
        print(
            f"  {mode:<12} {entry['tokens_per_second']:>10,.1f} {entry['ratio_median']:>7.3f} "
            f"{entry['ratio_min']:>6.3f}-{entry['ratio_max']:<6.3f} {entry['stall_per_save_median']:>13.3f} "
            f"{entry['stall_per_save_min']:>6.3f}-{entry['stall_per_save_max']:<6.3f}"
        )
    print(f"# ratio: tokens/s over the same system's run without saving; stall per save over the {counted_saves} saves counted")
    sync = result["modes"].get("sync", {}).get("save_shares")
    if sync:
        print("# synchronous save time (rank 0): " + ", ".join(f"{part} {share:.0%}" for part, share in sync.items()))


if __name__ == "__main__":
    main()
