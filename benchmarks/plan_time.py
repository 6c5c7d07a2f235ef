"""`fsdpkit plan --time` against measured steps: calibrate this machine, then predict and measure
side by side the step time at 1, 2 and 4 ranks for gpt-small, hf:llama-bench and a model with
many small units, under full and grad-op, with backward prefetch (pre) and without (none).

Each world size is one launch, calibrated just before it; inside it the configurations take
turns, one step each per round, so that load from other processes falls on all of them alike. Reported: the median step
(max over ranks of each step) with its spread, the prediction, and their ratio.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_time.py [--rounds 5] [--hardware FILE.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH", "")]))

MODELS = ("gpt-small", "hf:llama-bench", "plan_time:many_small")
STRATEGIES = ("full", "grad-op")
PREFETCH = ("pre", "none")


def many_small():
    """24 blocks of 64 wide: many units, each small (latency and per-unit costs dominate)."""
    from fsdpkit.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=24, n_head=2, n_embd=64))


def request_for(model: str, strategy: str, prefetch: str, world: int, batch: int, seq_len: int):
    from fsdpkit.memory_plan import PlanRequest
    from fsdpkit.train.config import TrainConfig

    values = {
        "model": {"name": model},
        "data": {"global_batch_size": batch * world, "seq_len": seq_len},
        "sharding": {"strategy": strategy, "backward_prefetch": prefetch},
    }
    return PlanRequest(TrainConfig.from_values(values), world)


def measure_worker(cases: list[tuple[str, str, str]], batch: int, seq_len: int, rounds: int) -> list[list[float]]:
    dist.init_process_group("gloo")
    try:
        return _measure(cases, batch, seq_len, rounds)
    finally:
        dist.destroy_process_group()


def _measure(cases: list[tuple[str, str, str]], batch: int, seq_len: int, rounds: int) -> list[list[float]]:
    import fsdpkit
    from fsdpkit.models.source import resolve
    from fsdpkit.train.model_setup import wrap_policy

    world = dist.get_world_size()
    runs = []
    for model_name, strategy, prefetch in cases:
        request = request_for(model_name, strategy, prefetch, world, batch, seq_len)
        source = resolve(model_name)
        torch.manual_seed(0)
        model = source.build(device="cpu", seed=0)
        model = fsdpkit.shard(model, request.sharding, wrap=wrap_policy(request.config.model, source, model), device="cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        runs.append((source, model, optimizer))
    times: list[list[float]] = [[] for _ in cases]
    vocab = 256
    for round_index in range(rounds + 1):  # the first round warms up
        for index, (source, model, optimizer) in enumerate(runs):
            tokens = torch.randint(0, vocab, (batch, seq_len + 1))
            dist.barrier()
            start = time.perf_counter()
            logits = source.logits(model, tokens[:, :-1])
            F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if round_index:
                times[index].append(float(elapsed))
    return times


def main() -> None:
    from fsdpkit.calibrate import calibrate
    from fsdpkit.hardware import load
    from fsdpkit.launch import LaunchOptions, launch
    from fsdpkit.time_plan import model_costs, predict

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--hardware", help="a profile; default: calibrate now, before each world size (gpt-small, 2 ranks)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    cases = [(m, s, p) for m in MODELS for s in STRATEGIES for p in PREFETCH]
    costs = {m: model_costs(request_for(m, "full", "pre", 1, args.batch, args.seq_len)) for m in MODELS}
    rows, profiles = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        # calibrated just before each launch, so that both see the machine as loaded then
        hardware = load(args.hardware) if args.hardware else calibrate(request_for("gpt-small", "full", "pre", 2, args.batch, args.seq_len))
        profiles.append(hardware)
        measured = launch(measure_worker, cases, args.batch, args.seq_len, args.rounds, options=LaunchOptions(nproc_per_node=world))[0]
        for (model, strategy, prefetch), times in zip(cases, measured, strict=True):
            request = request_for(model, strategy, prefetch, world, args.batch, args.seq_len)
            predicted = predict(request, hardware, costs[model], per_node=world).time.step_time_s
            median = statistics.median(times)
            rows.append(
                {
                    "model": model,
                    "strategy": strategy,
                    "prefetch": prefetch,
                    "world_size": world,
                    "predicted_s": predicted,
                    "measured_median_s": median,
                    "measured_min_s": min(times),
                    "measured_max_s": max(times),
                    "ratio": predicted / median,
                }
            )
    if args.json:
        print(json.dumps({"hardware": [p.to_values() for p in profiles], "rows": rows}))
        return
    for profile in profiles:
        print(f"# profile: {json.dumps(profile.to_values())}")
    load = os.getloadavg()[0]
    rounds = f"median of {args.rounds} alternating rounds"
    print(f"# {args.batch} x {args.seq_len} tokens per rank, AdamW; {rounds}; load average {load:.1f} at the end")
    print(f"{'model':<22} {'strategy':<8} {'prefetch':<8} {'W':>2} {'predicted s':>12} {'measured s':>11} {'spread s':>17} {'ratio':>6}")
    for row in rows:
        spread = f"{row['measured_min_s']:.3f}-{row['measured_max_s']:.3f}"
        print(
            f"{row['model']:<22} {row['strategy']:<8} {row['prefetch']:<8} {row['world_size']:>2} {row['predicted_s']:>12.4f} "
            f"{row['measured_median_s']:>11.4f} {spread:>17} {row['ratio']:>6.2f}"
        )
    within = sum(abs(row["ratio"] - 1) <= 0.15 for row in rows)
    print(f"# within 15%: {within} of {len(rows)}; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
