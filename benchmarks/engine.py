"""fsdpkit's engine side by side with torch FSDP2 (fully_shard), torch FSDP1
(FullyShardedDataParallel) and DistributedDataParallel: same model, seed, batches and ranks.

One launch of N ranks. Each rank first measures every system's peak memory alone (build it,
train 2 steps, free it; tensor bytes: CUDA's allocator counters, or on CPU the profiler's
allocation events, see tensor_memory.py), then builds all of them, warms each up, and runs
alternating trials (the order rotates every trial), `--steps` steps per system per trial.
A trial's time is the slowest rank's. Reported: median step time and its range, tokens/s,
peak memory per rank, and fsdpkit's ratio to each system, computed trial by trial (adjacent
runs) with the median and the 25-75% range. Every system must end at the same loss.

Before the trials, `--profile-steps` rounds each run one step of every system under the
torch profiler (rotating order), and the step is split into compute, exposed communication,
engine ops, optimizer and overhead (step_breakdown.py defines them; the table prints the
definitions), averaged over ranks and steps.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --model llama-small --nproc-per-node 2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --model gpt-small --nproc-per-node 4
    .venv/bin/python benchmarks/engine.py --model gpt-tiny --ablation      # prefetch / limiter on and off
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine.py --model hf:llama-bench --seq-len 256   # transformers Llama
    .venv/bin/python benchmarks/engine.py --model gpt2 --backend nccl --mixed-precision bf16 --batch 16 --seq-len 1024

On CUDA it also reports model TFLOP/s per GPU (6 * parameters * tokens / time / ranks) and
MFU against --peak-tflops (default 989: H100/H200 dense bf16).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine_systems import ENGINE_KINDS, SYSTEMS, RunSettings, build_system, global_loss, supported_engine_options, train_steps  # noqa: E402
from step_breakdown import CATEGORIES, DEFINITION, Breakdown, profile_breakdown  # noqa: E402
from tensor_memory import peak_training_bytes  # noqa: E402

from fsdpkit.dist.launch import LaunchOptions, launch  # noqa: E402
from fsdpkit.engine.config import ShardingConfig  # noqa: E402
from fsdpkit.train.data import TokenSource  # noqa: E402

QUANTIZED = ("fsdpkit-int8",)  # systems that compute with other weights: held to QUANTIZED_LOSS_TOLERANCE
QUANTIZED_LOSS_TOLERANCE = 2e-2
ABLATION = {  # label -> fsdpkit.shard options (the paper's prefetch / rate-limiter tables)
    "fsdpkit": {"backward_prefetch": "pre", "forward_prefetch": False, "limit_all_gathers": 2},
    "no-prefetch": {"backward_prefetch": "none", "forward_prefetch": False, "limit_all_gathers": 2},
    "no-limit": {"backward_prefetch": "pre", "forward_prefetch": False, "limit_all_gathers": 0},
    "fwd+bwd-prefetch": {"backward_prefetch": "pre", "forward_prefetch": True, "limit_all_gathers": 2},
    "no-prefetch-no-limit": {"backward_prefetch": "none", "forward_prefetch": False, "limit_all_gathers": 0},
}


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _mean_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.item() / dist.get_world_size()


def _variants(args: argparse.Namespace) -> list[tuple[str, str, dict]]:
    """(label, system kind, fsdpkit options) for each column of the run."""
    if args.ablation:
        return [(label, "fsdpkit", {**options, "bucket_bytes": args.bucket_bytes}) for label, options in ABLATION.items()]
    options = {
        "backward_prefetch": args.backward_prefetch,
        "forward_prefetch": args.forward_prefetch,
        "limit_all_gathers": args.limit_all_gathers,
        "bucket_bytes": args.bucket_bytes,
    }
    if args.bucket_sweep:
        sizes = [int(size) for size in args.bucket_sweep.split(",")]
        return [("fsdpkit" if size == sizes[0] else f"bucket-{size}", "fsdpkit", {**options, "bucket_bytes": size}) for size in sizes]
    return [(kind, kind, options if kind in ENGINE_KINDS else {}) for kind in args.systems.split(",")]


@record
def engine_worker(args: argparse.Namespace) -> dict:
    device = _device(args.backend)
    if args.backend == "nccl":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        return _run(args, device)
    finally:
        dist.destroy_process_group()


def _run(args: argparse.Namespace, device: torch.device) -> dict:
    from tqdm import tqdm

    rank0 = dist.get_rank() == 0
    variants = _variants(args)
    data = TokenSource("synthetic", vocab_size=resolve_model(args.model).vocab_size, seq_len=args.seq_len, seed=0)

    def settings_for(options: dict) -> RunSettings:
        return RunSettings(
            model=args.model,
            batch=args.batch,
            seq_len=args.seq_len,
            mixed_precision=args.mixed_precision,
            engine_options=options,
            compile=args.compile,
        )

    memory = {}
    for label, kind, options in tqdm(variants, desc="memory", disable=not rank0, file=sys.stderr):
        settings = settings_for(options)
        _, peak, start = peak_training_bytes(
            functools.partial(build_system, kind, settings, device, label=label),
            functools.partial(train_steps, data=data, settings=settings, device=device, steps=2),
            device,
        )
        memory[label] = {"peak_bytes": int(_max_over_ranks(peak, device)), "state_bytes": int(_max_over_ranks(start, device))}

    systems = [build_system(kind, settings_for(options), device, label=label) for label, kind, options in variants]
    for system in systems:
        train_steps(system, data, settings_for({}), device, args.warmup)
    sent = {}
    for system in systems:  # one more step each, its bytes counted
        before = system.sent_bytes() if system.sent_bytes is not None else 0
        train_steps(system, data, settings_for({}), device, 1)
        if system.sent_bytes is not None:
            sent[system.name] = int(_mean_over_ranks(system.sent_bytes() - before, device))
    breakdown = _profile_rounds(
        systems, lambda system, steps: train_steps(system, data, settings_for({}), device, steps), args.profile_steps, rank0
    )
    seconds = {system.name: [] for system in systems}
    cpu_seconds = {system.name: [] for system in systems}
    progress = tqdm(total=args.trials * len(systems), desc="trials", disable=not rank0, file=sys.stderr)
    for trial in range(args.trials):
        shift = trial % len(systems)
        for system in systems[shift:] + systems[:shift]:
            dist.barrier()
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            train_steps(system, data, settings_for({}), device, args.steps)
            _sync(device)
            cpu = time.process_time() - cpu_start
            seconds[system.name].append(_max_over_ranks((time.perf_counter() - start) / args.steps, device))
            cpu_seconds[system.name].append(_mean_over_ranks(cpu / args.steps, device))
            progress.update(1)
    progress.close()
    losses = {system.name: global_loss(system, device) for system in systems}
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "memory": memory,
        "losses": losses,
        "steps_per_system": systems[0].step,
        "breakdown": breakdown,
        "sent_bytes_per_step": sent,
    }


def _profile_rounds(systems: list, run, rounds: int, rank0: bool) -> dict[str, dict[str, float]]:
    """The step breakdown of every system, ms per step averaged over ranks: `rounds` rounds,
    each profiling one step of every system in rotating order (so load changes on a shared
    machine fall on all systems alike)."""
    from tqdm import tqdm

    totals = {system.name: Breakdown() for system in systems}
    for round_index in tqdm(range(rounds), desc="profile", disable=not rank0, file=sys.stderr):
        shift = round_index % len(systems)
        for system in systems[shift:] + systems[:shift]:
            dist.barrier()
            totals[system.name].add(profile_breakdown(functools.partial(run, system), 1))
    result = {}
    for name, total in totals.items():
        per_rank: list = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, total.per_step_ms())
        result[name] = {key: statistics.fmean(rank[key] for rank in per_rank) for key in per_rank[0]}
    return result if rounds else {}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(args: argparse.Namespace, result: dict, num_params: int) -> dict:
    tokens = args.batch * args.seq_len
    world = args.nproc_per_node
    seconds = result["seconds"]
    reference = "fsdpkit"
    rows = []
    loss_ref = result["losses"][reference]
    for name, samples in seconds.items():
        median = statistics.median(samples)
        ratios = [mine / theirs for mine, theirs in zip(seconds[reference], samples, strict=True)]
        cpu = result["cpu_seconds"][name]
        cpu_ratios = [mine / theirs for mine, theirs in zip(result["cpu_seconds"][reference], cpu, strict=True)]
        row = {
            "system": name,
            "step_ms_median": median * 1e3,
            "step_ms_min": min(samples) * 1e3,
            "step_ms_max": max(samples) * 1e3,
            "tokens_per_s": tokens / median,
            "peak_bytes_per_rank": result["memory"][name]["peak_bytes"],
            "state_bytes_per_rank": result["memory"][name]["state_bytes"],
            "final_loss": result["losses"][name],
            "loss_rel_diff": abs(result["losses"][name] - loss_ref) / abs(loss_ref),
            "fsdpkit_time_ratio": statistics.median(ratios),
            "fsdpkit_time_ratio_p25": _quantile(ratios, 0.25),
            "fsdpkit_time_ratio_p75": _quantile(ratios, 0.75),
            "cpu_ms_median": statistics.median(cpu) * 1e3,
            "fsdpkit_cpu_ratio": statistics.median(cpu_ratios),
            "fsdpkit_memory_ratio": result["memory"][reference]["peak_bytes"] / result["memory"][name]["peak_bytes"],
        }
        row["sent_bytes_per_step"] = result["sent_bytes_per_step"].get(name)
        if args.backend == "nccl":
            row["model_tflops_per_gpu"] = 6 * num_params * tokens / median / world / 1e12
            row["mfu"] = row["model_tflops_per_gpu"] / args.peak_tflops
        rows.append(row)
    exact = [row for row in rows if row["system"] not in QUANTIZED]
    worst = max(row["loss_rel_diff"] for row in exact)
    quantized_agree = all(row["loss_rel_diff"] <= QUANTIZED_LOSS_TOLERANCE for row in rows if row["system"] in QUANTIZED)
    return {
        "model": args.model,
        "num_params": num_params,
        "world_size": world,
        "backend": args.backend,
        "device": "cuda" if args.backend == "nccl" else "cpu",
        "mixed_precision": args.mixed_precision,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "tokens_per_step": tokens,
        "trials": args.trials,
        "steps_per_trial": args.steps,
        "warmup_steps": args.warmup,
        "steps_per_system": result["steps_per_system"],
        "ablation": args.ablation,
        "memory_measure": "CUDA max_memory_allocated"
        if args.backend == "nccl"
        else "live CPU tensor bytes from torch.profiler allocation events",
        "loss_tolerance": args.loss_tolerance,
        "losses_agree": worst <= args.loss_tolerance and quantized_agree,
        "rows": rows,
        "profile_steps": args.profile_steps,
        "breakdown_ms_per_step": result["breakdown"],
        "breakdown_definition": DEFINITION,
        "targets": targets(seconds, result["sent_bytes_per_step"]),
    }


def _ratio_summary(ratios: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ratios), "p25": _quantile(ratios, 0.25), "p75": _quantile(ratios, 0.75)}


def targets(seconds: dict[str, list[float]], sent: dict[str, int]) -> dict[str, dict[str, float]]:
    """The ratios the engine is held to, trial by trial: fsdpkit-int8 against DDP (time and
    bytes sent per rank per step), fsdpkit against the faster of FSDP1 and FSDP2."""
    result = {}
    if "fsdpkit-int8" in seconds and "ddp" in seconds:
        result["int8_vs_ddp_time"] = _ratio_summary([a / b for a, b in zip(seconds["fsdpkit-int8"], seconds["ddp"], strict=True)])
        if sent.get("ddp"):
            result["int8_vs_ddp_time"]["bytes"] = sent["fsdpkit-int8"] / sent["ddp"]
    if "fsdpkit" in seconds and "fsdp1" in seconds and "fsdp2" in seconds:
        faster = [min(a, b) for a, b in zip(seconds["fsdp1"], seconds["fsdp2"], strict=True)]
        result["fsdpkit_vs_faster_fsdp"] = _ratio_summary([a / b for a, b in zip(seconds["fsdpkit"], faster, strict=True)])
    return result


def format_table(summary: dict) -> str:
    cuda = summary["backend"] == "nccl"
    lines = [
        f"# {summary['model']} ({summary['num_params']:,} params), {summary['world_size']} ranks, "
        f"{summary['backend']}/{summary['device']}, "
        f"{summary['mixed_precision']}, batch {summary['batch']} x seq {summary['seq_len']} = {summary['tokens_per_step']} tokens/step; "
        f"{summary['trials']} alternating trials x {summary['steps_per_trial']} steps after {summary['warmup_steps']} warmup",
        f"# memory: {summary['memory_measure']}, peak per rank while training; ratios: fsdpkit / system, trial by trial, median [25%..75%]",
        "# cpu ms: process CPU time per step (all threads, gloo's included), mean over ranks: "
        "less sensitive to a busy machine than wall time",
        f"  {'system':<22} {'step ms':>9} {'[min..max]':>17} {'tokens/s':>9} {'peak MiB':>9} {'final loss':>11}"
        f" {'time ratio':>10} {'[25..75%]':>13} {'mem ratio':>9} {'cpu ms':>8} {'cpu ratio':>9} {'sent MiB':>9}"
        + (f" {'TFLOP/s':>8} {'MFU':>6}" if cuda else ""),
    ]
    for row in summary["rows"]:
        step_range = f"[{row['step_ms_min']:.1f}..{row['step_ms_max']:.1f}]"
        ratio_range = f"[{row['fsdpkit_time_ratio_p25']:.3f}..{row['fsdpkit_time_ratio_p75']:.3f}]"
        line = (
            f"  {row['system']:<22} {row['step_ms_median']:>9.1f} {step_range:>17}"
            f" {row['tokens_per_s']:>9.0f} {row['peak_bytes_per_rank'] / 2**20:>9.1f} {row['final_loss']:>11.6f}"
            f" {row['fsdpkit_time_ratio']:>10.3f} {ratio_range:>13} {row['fsdpkit_memory_ratio']:>9.3f}"
            f" {row['cpu_ms_median']:>8.1f} {row['fsdpkit_cpu_ratio']:>9.3f}"
            f" {(row['sent_bytes_per_step'] or 0) / 2**20:>9.2f}"
        )
        if cuda:
            line += f" {row['model_tflops_per_gpu']:>8.1f} {row['mfu'] * 100:>5.1f}%"
        lines.append(line)
    if summary["breakdown_ms_per_step"]:
        lines += format_breakdown(summary)
    for name, ratio in summary["targets"].items():
        extra = f"; bytes sent per rank per step {ratio['bytes']:.3f}" if "bytes" in ratio else ""
        lines.append(f"# {name}: time {ratio['median']:.3f} [{ratio['p25']:.3f}..{ratio['p75']:.3f}]{extra}")
    verdict = "agree" if summary["losses_agree"] else "DISAGREE"
    lines.append(
        f"# final losses after {summary['steps_per_system']} steps {verdict} within {summary['loss_tolerance']:g} "
        f"(worst relative difference {max(r['loss_rel_diff'] for r in summary['rows'] if r['system'] not in QUANTIZED):.2e}); "
        f"int8 all-gather within {QUANTIZED_LOSS_TOLERANCE:g} (it trains a quantized model)"
    )
    return "\n".join(lines)


def format_breakdown(summary: dict) -> list[str]:
    lines = [
        f"# where a step goes: {summary['profile_steps']} profiled steps per system, ms per step (share), mean over ranks",
        f"  {'system':<22} {'step ms':>8}" + "".join(f" {name:>15}" for name in CATEGORIES) + f" {'comm busy':>10}",
    ]
    for name, parts in summary["breakdown_ms_per_step"].items():
        step = parts["step"]
        cells = "".join(f" {parts[c]:>7.1f} ({parts[c] / step:>4.0%})" for c in CATEGORIES)
        lines.append(f"  {name:<22} {step:>8.1f}{cells} {parts['comm_busy']:>10.1f}")
    lines += ["#   " + line for line in DEFINITION.splitlines()]
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default="gpt-small",
        help="gpt-tiny, gpt-small, gpt2, ..., llama-small, hf:PRESET|DIR (e.g. hf:llama-bench), or package.module:factory",
    )
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per system per trial")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=4, help="rounds of one profiled step per system, for the breakdown (0: none)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mixed-precision", default="none", choices=("none", "bf16"))
    parser.add_argument("--backward-prefetch", default="pre", choices=("pre", "post", "none"))
    parser.add_argument("--forward-prefetch", action="store_true")
    parser.add_argument("--compile", action="store_true", help="torch.compile each unit's forward in every system (FSDP1: not compiled)")
    parser.add_argument("--limit-all-gathers", type=int, default=2)
    parser.add_argument(
        "--bucket-bytes",
        type=int,
        default=ShardingConfig().bucket_bytes,
        help=f"fsdpkit: merge consecutive units smaller than this (default {ShardingConfig().bucket_bytes}, the engine's; 0: none)",
    )
    parser.add_argument(
        "--bucket-sweep",
        default="",
        help="fsdpkit only: one column per --bucket-bytes value, e.g. 0,1048576,4194304 (0: unbucketed; ratios: first / each)",
    )
    parser.add_argument("--ablation", action="store_true", help="fsdpkit only: prefetch and limiter on/off side by side")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="per-GPU peak for MFU (989: H100/H200 bf16 dense)")
    parser.add_argument("--loss-tolerance", type=float, default=None, help="relative; default 1e-3 fp32, 3e-2 bf16")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(argv)
    if args.loss_tolerance is None:
        args.loss_tolerance = 3e-2 if args.mixed_precision == "bf16" else 1e-3
    if args.batch % args.nproc_per_node:
        parser.error(f"--batch {args.batch} is not divisible by --nproc-per-node {args.nproc_per_node}")
    if args.trials < 1 or args.steps < 1:
        parser.error(f"--trials {args.trials} and --steps {args.steps} must be >= 1")
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}: use {','.join(SYSTEMS)}")
    if "fsdpkit" not in args.systems.split(",") and not (args.ablation or args.bucket_sweep):
        parser.error("--systems must include fsdpkit (ratios are fsdpkit's)")
    return args


def main() -> None:
    args = parse_args()
    _, missing = supported_engine_options({"backward_prefetch": 0, "forward_prefetch": 0, "limit_all_gathers": 0})
    if missing:
        print(f"# this engine does not accept {missing}: those flags are ignored", file=sys.stderr)
    started = time.perf_counter()
    results = launch(engine_worker, args, options=LaunchOptions(nproc_per_node=args.nproc_per_node))
    num_params = resolve_model(args.model).num_params
    summary = summarize(args, results[0], num_params)
    summary["wall_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_table(summary))
        print(f"# wall {summary['wall_seconds']:.0f} s")
    if not summary["losses_agree"]:
        sys.exit(3)


if __name__ == "__main__":
    main()
