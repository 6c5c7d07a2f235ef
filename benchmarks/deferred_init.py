"""Peak memory while materialising a model with deferred (meta-device) initialisation: each
rank builds one unit at a time and keeps only its shard, so the peak stays near one unit plus
the rank's shards, far below the unsharded model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/deferred_init.py --model gpt2-large --nproc-per-node 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

import fsdpkit
from fsdpkit.dist.launch import LaunchOptions, launch
from fsdpkit.engine.wrapping import split_units
from fsdpkit.models.source import build_model
from fsdpkit.models.units import default_policy_for_model
from fsdpkit.sizes import format_size


def _rss_now() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@record
def worker(model_name: str, deferred: bool) -> dict:
    dist.init_process_group("gloo")
    try:
        baseline = _rss_now()
        torch.manual_seed(0)
        model = build_model(model_name, device="meta" if deferred else "cpu")
        model = fsdpkit.shard(model, wrap=default_policy_for_model(model_name))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
        values = torch.tensor([peak, fsdpkit.local_shard_bytes(model)], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return {"init_peak": int(values[0]), "shard_bytes": int(values[1])}
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--nproc-per-node", type=int, default=4)
    parser.add_argument("--eager", action="store_true", help="also measure eager initialisation (needs the whole model per rank)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    meta = build_model(args.model, device="meta")
    units = split_units(meta, default_policy_for_model(args.model))
    model_bytes = sum(p.numel() for p in meta.parameters()) * 4
    largest_unit = max(sum(torch.Size(p.shape).numel() for p in unit.params) for unit in units) * 4
    options = LaunchOptions(nproc_per_node=args.nproc_per_node)
    rows = {"deferred": launch(worker, args.model, True, options=options)[0]}
    if args.eager:
        rows["eager"] = launch(worker, args.model, False, options=options)[0]
    document = {
        "model": args.model,
        "world_size": args.nproc_per_node,
        "model_bytes": model_bytes,
        "largest_unit_bytes": largest_unit,
        **rows,
    }
    if args.json:
        print(json.dumps(document))
        return
    shard = rows["deferred"]["shard_bytes"]
    print(f"# {args.model} at {args.nproc_per_node} ranks: RSS growth while building and sharding (max over ranks)")
    print(f"unsharded model (fp32)           {format_size(model_bytes):>12}")
    print(
        f"largest unit + this rank's shards {format_size(largest_unit + shard):>11}  ({format_size(largest_unit)} + {format_size(shard)})"
    )
    for name, row in rows.items():
        print(
            f"{name + ' init peak':<32} {format_size(row['init_peak']):>12}  = {row['init_peak'] / model_bytes:.2f} x model,"
            f" {row['init_peak'] / (largest_unit + shard):.2f} x (unit + shards)"
        )


if __name__ == "__main__":
    main()
