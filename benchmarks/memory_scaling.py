"""Peak memory per rank as the world size grows: the same model trained
for a few steps at world sizes 1, 2 and 4, reporting the engine's own byte counters (peak of
sharded state + unsharded units in flight + optimizer state) and the process's peak RSS.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_scaling.py --model gpt2 --world-sizes 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import fsdpkit
from fsdpkit.dist.launch import LaunchOptions, launch
from fsdpkit.models.source import build_model
from fsdpkit.models.units import default_policy_for_model
from fsdpkit.sizes import format_size


def _rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@record
def worker(model_name: str, steps: int, batch: int, seq_len: int) -> dict:
    dist.init_process_group("gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        baseline = _rss_now()
        torch.manual_seed(0)
        with torch.device("meta"):
            model = build_model(model_name, device="meta")
        model = fsdpkit.shard(model, wrap=default_policy_for_model(model_name))
        optimizer = torch.optim.AdamW(fsdpkit.param_groups(model, weight_decay=0.1), lr=1e-4)
        generator = torch.Generator().manual_seed(1)
        for _ in range(steps):
            tokens = torch.randint(0, model.vocab_size, (batch, seq_len + 1), generator=generator)
            rows = batch // world
            local = tokens[rank * rows : (rank + 1) * rows]
            F.cross_entropy(model(local[:, :-1]).flatten(0, 1), local[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        stats = fsdpkit.memory_stats(model, optimizer)
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        values = torch.tensor([stats["peak_total"], peak_rss - baseline, peak_rss], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {"engine_peak": int(values[0]), "rss_growth": int(values[1]), "peak_rss": int(values[2])}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # glibc raises its mmap threshold after large frees and then keeps freed blocks in the heap,
    # so peak RSS would count memory the engine already released; a fixed threshold avoids that.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = []
    for world in args.world_sizes:
        result = launch(worker, args.model, args.steps, args.batch, args.seq_len, options=LaunchOptions(nproc_per_node=world))[0]
        rows.append({"world_size": world, **result})
        print(f"world size {world}: done", file=sys.stderr)
    if args.json:
        print(json.dumps({"model": args.model, "rows": rows}))
        return
    first = rows[0]
    print(f"# {args.model}: peak memory per rank (max over ranks), {args.steps} AdamW steps, batch {args.batch} x {args.seq_len}")
    versus_first = f"vs W={first['world_size']}"
    print(f"{'world':>6} {'engine peak':>14} {versus_first:>9} {'RSS growth':>14} {versus_first:>9} {'peak RSS':>12}")
    for row in rows:
        print(
            f"{row['world_size']:>6} {format_size(row['engine_peak']):>14} {row['engine_peak'] / first['engine_peak']:>9.2f}"
            f" {format_size(row['rss_growth']):>14} {row['rss_growth'] / first['rss_growth']:>9.2f} {format_size(row['peak_rss']):>12}"
        )
    print(
        "# engine peak: sharded params + grads + optimizer state + unsharded units in flight (fsdpkit.memory_stats);"
        " RSS growth: peak RSS minus RSS before the model was built (includes activations)"
    )


if __name__ == "__main__":
    main()
