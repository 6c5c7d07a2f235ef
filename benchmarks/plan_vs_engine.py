"""Does `fsdpkit plan` predict what the engine holds? The plan against the engine's own
byte counters (fsdpkit.memory_stats) at world sizes 1, 2 and 4 for two models, and the
activation memory the plan leaves out next to it.

One launch per world size; each rank trains each model for 2 AdamW steps. Columns:
plan and engine bytes of the persistent state (sharded parameters + gradients + optimizer
state) and of the peak (state + unsharded in flight); ratio = engine peak / plan peak
(target within 15%); measured = peak live tensor bytes while training (CPU: profiler
allocation events, CUDA: max_memory_allocated; see tensor_memory.py); activations =
measured - engine peak, roughly what the plan leaves out (activations, temporaries,
collective buffers). Rank 0 shown; every rank's exact match is checked.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/plan_vs_engine.py --models gpt-tiny,gpt-small --world-sizes 1,2,4
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tensor_memory import peak_training_bytes  # noqa: E402

import fsdpkit  # noqa: E402
from fsdpkit.dist.launch import LaunchOptions, launch  # noqa: E402
from fsdpkit.models.gpt import Block  # noqa: E402
from fsdpkit.models.source import build_model  # noqa: E402
from fsdpkit.plan.memory import plan_memory  # noqa: E402
from fsdpkit.train.config import TrainConfig  # noqa: E402
from fsdpkit.train.data import TokenSource, local_rows  # noqa: E402


def _build(name: str, strategy: str):
    torch.manual_seed(0)
    model = fsdpkit.shard(build_model(name), wrap=(Block,), strategy=strategy)
    return model, torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-3)


def _train(system, data: TokenSource, batch: int):
    model, optimizer = system
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        rows = local_rows(data.global_batch(step, batch), rank, world)
        F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return fsdpkit.memory_stats(model, optimizer)


@record
def counters_worker(models: list[str], batch: int, seq_len: int, strategy: str) -> dict:
    dist.init_process_group("gloo")
    try:
        out = {}
        for name in models:
            data = TokenSource("synthetic", vocab_size=build_model(name, device="meta").vocab_size, seq_len=seq_len, seed=0)
            stats, measured, _ = peak_training_bytes(
                functools.partial(_build, name, strategy), functools.partial(_train, data=data, batch=batch), torch.device("cpu")
            )
            out[name] = {**stats, "measured_peak": measured}
        return out
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-tiny,gpt-small")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--strategy", default="full")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    models = args.models.split(",")
    rows = []
    for world in (int(w) for w in args.world_sizes.split(",")):
        results = launch(counters_worker, models, args.batch, args.seq_len, args.strategy, options=LaunchOptions(nproc_per_node=world))
        for name in models:
            for rank in sorted(results):
                stats = results[rank][name]
                request = TrainConfig.from_values({"model": {"name": name}, "sharding": {"strategy": args.strategy}}).plan_request(world)
                plan = plan_memory(request, shard_rank=rank % request.sharding.shard_factor(world))
                state_plan = plan.persistent
                state_engine = stats["sharded_params"] + stats["sharded_grads"] + stats["optimizer_state"]
                row = {
                    "model": name,
                    "world_size": world,
                    "rank": rank,
                    "state_plan": state_plan,
                    "state_engine": state_engine,
                    "state_exact": state_plan == state_engine,
                    "peak_plan": plan.device_total,
                    "peak_engine": stats["peak_total"],
                    "ratio": stats["peak_total"] / plan.device_total,
                    "measured_peak": stats["measured_peak"],
                    "activations": stats["measured_peak"] - stats["peak_total"],
                }
                rows.append(row)
    if args.json:
        print(json.dumps({"strategy": args.strategy, "batch": args.batch, "seq_len": args.seq_len, "rows": rows}))
        return
    print(
        f"# plan vs engine counters, strategy {args.strategy}, AdamW, fp32, global batch {args.batch} x seq {args.seq_len}; "
        "rank 0 of each run"
    )
    print(
        f"  {'model':<10} {'W':>2} {'state plan':>12} {'state engine':>13} {'peak plan':>11} {'peak engine':>12} {'ratio':>6}"
        f" {'measured':>11} {'activations':>12} {'act/measured':>12}"
    )
    for row in rows:
        if row["rank"]:
            continue
        print(
            f"  {row['model']:<10} {row['world_size']:>2} {row['state_plan']:>12,} {row['state_engine']:>13,} {row['peak_plan']:>11,}"
            f" {row['peak_engine']:>12,} {row['ratio']:>6.3f} {row['measured_peak']:>11,} {row['activations']:>12,}"
            f" {row['activations'] / row['measured_peak']:>12.1%}"
        )
    exact = all(row["state_exact"] for row in rows)
    worst = max(abs(row["ratio"] - 1) for row in rows)
    print(f"# every rank: persistent state {'equal' if exact else 'NOT equal'}; worst peak ratio off by {worst:.1%} (target 15%)")
    if not exact or worst > 0.15:
        sys.exit(3)


if __name__ == "__main__":
    main()
