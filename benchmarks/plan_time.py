"""`fsdpkit plan --time` against measured steps: calibrate this machine, then predict and measure
side by side the step time at 1, 2 and 4 ranks for gpt-small, hf:llama-bench and a model with
many small units, under full and grad-op, with backward prefetch (pre) and without (none).

Each world size is one launch. In it the configurations and the steps `plan --calibrate` times
take turns, one step each per round, so that the machine's drifting speed and load from other
processes fall on all of them alike; the profile is fitted from those calibration steps with the
functions `plan --calibrate` uses. Reported: the median step (max over ranks of each step) with
its spread, the prediction, and their ratio; the profile and the calibration's own medians.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_time.py [--rounds 15] [--seconds 40] [--calibrate-seconds 10] [--hardware FILE.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))

MODELS = ("gpt-small", "hf:llama-bench", "plan_time:many_small")
STRATEGIES = ("full", "grad-op")
PREFETCH = ("pre", "none")
FIT_REPEATS = 2  # per round, for the busy-cores, link and more-ranks steps: about as many as plan --calibrate takes


def many_small():
    """24 blocks of 64 wide: many units, each small (latency and per-unit costs dominate)."""
    from fsdpkit.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=24, n_head=2, n_embd=64))


def request_for(model: str, strategy: str, prefetch: str, world: int, batch: int, seq_len: int):
    from fsdpkit.train.config import TrainConfig

    values = {
        "model": {"name": model},
        "data": {"global_batch_size": batch * world, "seq_len": seq_len},
        "sharding": {"strategy": strategy, "backward_prefetch": prefetch},
    }
    return TrainConfig.from_values(values).plan_request(world)


@dataclass
class Timed:
    """A step that `ranks` take `repeats` times per round, and its times (each the slowest of those ranks)."""

    ranks: tuple[int, ...]
    group: Any  # their process group (None: every rank)
    step: Callable[[], tuple[float, ...]] | None  # None on the ranks that do not take it
    repeats: int = 1
    times: list[tuple[float, ...]] = field(default_factory=list)


def measure_worker(cases: list[tuple[str, str, str]], batch: int, seq_len: int, rounds: int, seconds: float, calibrate: bool) -> dict:
    """The configurations' steps and, with `calibrate`, the calibration's steps taking turns with
    them in the same rounds: at least `rounds` (after one to warm up) and `seconds` of the
    configurations' steps. While some ranks take a step, the others wait at a barrier."""
    dist.init_process_group("gloo")
    try:
        world = dist.get_world_size()
        configs = [Timed(tuple(range(world)), None, whole_step(config_run(case, batch, seq_len), batch)) for case in cases]
        calibration = Calibration.build(batch, seq_len) if calibrate else None
        timed = (calibration.timed() if calibration else []) + configs
        round_index = 0
        while round_index <= rounds or sum(t[0] for c in configs for t in c.times) < seconds:  # the same on every rank
            for item in timed:
                for _ in range(item.repeats):
                    dist.barrier()
                    if dist.get_rank() in item.ranks:
                        assert item.step is not None
                        elapsed = torch.tensor(item.step())
                        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=item.group)
                        if round_index:
                            item.times.append(tuple(elapsed.tolist()))
            round_index += 1
        return {"configs": [[t[0] for t in c.times] for c in configs], "calibration": calibration.result() if calibration else None}
    finally:
        dist.destroy_process_group()


def config_run(case: tuple[str, str, str], batch: int, seq_len: int):
    """A configuration sharded by the engine over every rank, as `plan --calibrate` runs its `--model`."""
    from fsdpkit.plan.calibrate.measure import ModelRun

    model, strategy, prefetch = case
    return ModelRun(request_for(model, strategy, prefetch, dist.get_world_size(), batch, seq_len), model)


def whole_step(run, batch: int) -> Callable[[], tuple[float, ...]]:
    """A ModelRun's training step (forward, backward, optimizer), timed as one."""
    return lambda: (sum(run.step(batch)),)


@dataclass
class Calibration:
    """What `plan --calibrate` (gpt-small, 2 ranks) times, in the same rounds as the configurations:
    the probes and the compute steps on rank 0 alone; the link steps (the latency model under full and grad-op,
    gpt-small) on ranks 0 and 1;
    the all-cores pair (`--model` on rank 0 alone, then on each rank per core at once) and the more-ranks steps on
    every rank, where the launch has as many ranks as those take."""

    probe: Any  # the Probes, on rank 0
    probes: Timed
    compute: list[tuple[Any, int, Timed]]  # (ModelRun on rank 0, batch, its step)
    link: list[Timed]
    all_cores: list[Timed]
    more: list[Timed]

    @classmethod
    def build(cls, batch: int, seq_len: int) -> Calibration:
        from fsdpkit.plan.calibrate.measure import ModelRun, Probes, on_first_ranks
        from fsdpkit.plan.calibrate.runs import (
            CALIBRATION_BATCHES,
            TimedStep,
            all_cores_runs,
            calibration_specs,
            link_runs,
            more_ranks,
            more_ranks_runs,
        )

        world, rank = dist.get_world_size(), dist.get_rank()
        request = calibration_request(batch, seq_len)
        alone = dist.new_group([0])
        probe = Probes() if rank == 0 else None
        probes = Timed((0,), alone, probe.time if probe else None)
        compute = []
        for spec in calibration_specs(request):
            run = ModelRun(request, spec, group=alone) if rank == 0 else None
            for size in CALIBRATION_BATCHES:
                compute.append((run, size, Timed((0,), alone, (lambda run=run, size=size: run.step(size)) if run else None)))
        steps: dict[str, list[Timed]] = {"link": [], "all_cores": [], "more": []}
        runs = [(TimedStep(run), "link") for run in link_runs(request)] if world >= 2 else []
        cores = len(os.sched_getaffinity(0))
        all_cores = all_cores_runs(request, cores)
        if world >= all_cores[1].ranks:
            runs += [(placement, "all_cores") for placement in all_cores]
        if world == more_ranks(cores):
            runs += [(TimedStep(run), "more") for run in more_ranks_runs(request, cores)]
        for placement, kind in runs:
            group, model = on_first_ranks(placement)
            step = whole_step(model, placement.run.micro_batch) if model else None
            steps[kind].append(Timed(tuple(range(placement.ranks)), group, step, FIT_REPEATS))
        return cls(probe, probes, compute, steps["link"], steps["all_cores"], steps["more"])

    def timed(self) -> list[Timed]:
        return [
            self.probes,
            *(timed for _, _, timed in self.compute),
            *(timed for steps in self.profile_steps().values() for timed in steps),
        ]

    def profile_steps(self) -> dict[str, list[Timed]]:
        """The steps of the busy-cores, link and more-ranks terms, by kind."""
        return {"link": self.link, "all_cores": self.all_cores, "more": self.more}

    def result(self) -> dict | None:
        """On rank 0: measure_steps' (peak, memory rates, samples), the medians of the link,
        all-cores and more-ranks steps, and their times in the order taken."""
        if dist.get_rank() != 0:
            return None
        peak, memory = self.probe.rates(self.probes.times)
        samples = [run.sample(size, timed.times, memory) for run, size, timed in self.compute]
        times = {kind: [[t[0] for t in timed.times] for timed in steps] for kind, steps in self.profile_steps().items()}
        medians = {kind: [statistics.median(step) for step in steps] for kind, steps in times.items()}
        return {"compute": (peak, memory, samples), **medians, "times": times}


def calibration_request(batch: int, seq_len: int):
    return request_for("gpt-small", "full", "pre", 2, batch, seq_len)


def measured_hardware(result: dict, network: tuple[float, float], batch: int, seq_len: int):
    """The profile `plan --calibrate` would fit from these measurements."""
    from fsdpkit.plan.calibrate.fit import all_cores_slowdown, fit_collectives, measured_profile
    from fsdpkit.plan.calibrate.measure import Measured
    from fsdpkit.plan.calibrate.runs import link_runs, more_ranks_runs

    request = calibration_request(batch, seq_len)
    profile = measured_profile(request, result["compute"], network, 2)
    if not result["link"]:
        return profile
    more = more_ranks_runs(request, profile.compute_slots) if result["more"] else ()
    measured = [Measured(run, seconds) for run, seconds in zip(more, result["more"], strict=True)]
    link = [Measured(run, seconds) for run, seconds in zip(link_runs(request), result["link"], strict=True)]
    if result["all_cores"]:
        profile = replace(profile, all_cores_slowdown=all_cores_slowdown(*result["all_cores"]))
    return fit_collectives(profile, link, measured)


def world_rows(
    args: argparse.Namespace, cases: list[tuple[str, str, str]], world: int, hardware, separate, measured: list[list[float]], costs
) -> list[dict]:
    """A row per configuration: the prediction from the profile calibrated in the launch's rounds
    (or read from --hardware), the one from the separate calibration if any, and the measured steps."""
    from fsdpkit.plan.predict import predict

    rows = []
    for (model, strategy, prefetch), times in zip(cases, measured, strict=True):
        request = request_for(model, strategy, prefetch, world, args.batch, args.seq_len)
        predicted, median = predict(request, hardware, costs[model], per_node=world).time.step_time_s, statistics.median(times)
        row = {
            "model": model,
            "strategy": strategy,
            "prefetch": prefetch,
            "world_size": world,
            "predicted_s": predicted,
            "measured_median_s": median,
            "measured_min_s": min(times),
            "measured_max_s": max(times),
            "ratio": predicted / median,
            "times_s": times,
        }
        if separate is not None:
            row["separate_predicted_s"] = predict(request, separate, costs[model], per_node=world).time.step_time_s
            row["separate_ratio"] = row["separate_predicted_s"] / median
        rows.append(row)
    return rows


def same_step_spread(rows: list[dict]) -> dict[str, float]:
    """Per model, how far apart (max over min, less 1) the medians of its configurations at 1 rank
    are: there strategy and prefetch change nothing, so this is how far the measurement itself
    moves the same step in the same rounds."""
    medians: dict[str, list[float]] = {}
    for row in rows:
        if row["world_size"] == 1:
            medians.setdefault(row["model"], []).append(row["measured_median_s"])
    return {model: max(values) / min(values) - 1 for model, values in medians.items()}


def main() -> None:
    from fsdpkit.dist.launch import LaunchOptions, launch
    from fsdpkit.plan.calibrate import calibrate
    from fsdpkit.plan.calibrate.measure import network_line
    from fsdpkit.plan.predict import model_costs
    from fsdpkit.plan.profile import load

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="at least")
    parser.add_argument("--seconds", type=float, default=40.0, help="of the configurations' steps per world size, at least")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--hardware", help="a profile to predict with, instead of calibrating in the launches")
    parser.add_argument("--separate", action="store_true", help="also predict from plan --calibrate run just before each launch")
    parser.add_argument("--calibrate-seconds", type=float, default=10.0, help="of the separate calibration, as plan --calibrate-seconds")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    cases = [(m, s, p) for m in MODELS for s in STRATEGIES for p in PREFETCH]
    costs = {m: model_costs(request_for(m, "full", "pre", 1, args.batch, args.seq_len)) for m in MODELS}
    rows, profiles, calibrations = [], [], []
    for world in (int(w) for w in args.worlds.split(",")):
        separate = calibrate(calibration_request(args.batch, args.seq_len), seconds=args.calibrate_seconds) if args.separate else None
        network = None if args.hardware else network_line(2, 0.0)
        result = launch(
            measure_worker,
            cases,
            args.batch,
            args.seq_len,
            args.rounds,
            args.seconds,
            not args.hardware,
            options=LaunchOptions(nproc_per_node=world),
        )[0]
        hardware = load(args.hardware) if args.hardware else measured_hardware(result["calibration"], network, args.batch, args.seq_len)
        profiles.append(hardware)
        if result["calibration"]:
            calibrations.append(
                {
                    "world_size": world,
                    "bench_bus_gbs": network[1] / 1e9,  # fsdpkit bench's, before the steps' fit
                    "link_s": result["calibration"]["link"],
                    "all_cores_s": result["calibration"]["all_cores"],
                    "more_ranks_s": result["calibration"]["more"],
                    "times_s": result["calibration"]["times"],
                }
            )
        rows += world_rows(args, cases, world, hardware, separate, result["configs"], costs)
    if args.json:
        document = {"hardware": [p.to_values() for p in profiles], "calibration_steps": calibrations, "rows": rows}
        document["same_step_spread"] = same_step_spread(rows)
        print(json.dumps(document))
        return
    print_table(args, profiles, calibrations, rows, time.perf_counter() - started)


def print_table(args: argparse.Namespace, profiles, calibrations: list[dict], rows: list[dict], seconds: float) -> None:
    for profile in profiles:
        print(f"# profile: {json.dumps(profile.to_values())}")
    for steps in calibrations:
        print(f"# calibration steps: {json.dumps({key: value for key, value in steps.items() if key != 'times_s'})}")
    load = os.getloadavg()[0]
    rounds = f"median of at least {args.rounds} alternating rounds and {args.seconds:g} s"
    print(f"# {args.batch} x {args.seq_len} tokens per rank, AdamW; {rounds}; load average {load:.1f} at the end")
    header = f"{'model':<22} {'strategy':<8} {'prefetch':<8} {'W':>2} {'predicted s':>12} {'measured s':>11} {'spread s':>17} {'ratio':>6}"
    print(header + (f" {'separate s':>11} {'ratio':>6}" if args.separate else ""))
    for row in rows:
        spread = f"{row['measured_min_s']:.3f}-{row['measured_max_s']:.3f}"
        line = (
            f"{row['model']:<22} {row['strategy']:<8} {row['prefetch']:<8} {row['world_size']:>2} {row['predicted_s']:>12.4f} "
            f"{row['measured_median_s']:>11.4f} {spread:>17} {row['ratio']:>6.2f}"
        )
        print(line + (f" {row['separate_predicted_s']:>11.4f} {row['separate_ratio']:>6.2f}" if args.separate else ""))
    within = sum(abs(row["ratio"] - 1) <= 0.15 for row in rows)
    separately = f"; calibrated separately: {sum(abs(row['separate_ratio'] - 1) <= 0.15 for row in rows)}" if args.separate else ""
    print(f"# within 15%: {within} of {len(rows)}{separately}; {seconds:.0f} s in all")
    spread = same_step_spread(rows)
    if spread:
        apart = ", ".join(f"{model} {value:.0%}" for model, value in spread.items())
        print(f"# at 1 rank, where a model's configurations take the same step, their medians lie apart by up to: {apart}")


if __name__ == "__main__":
    main()
