"""torch FSDP2 training with torch DCP's `async_save`, measured the way `fsdpkit train --json`
measures itself, for benchmarks/save_overhead.py: one run of one mode, one JSON summary.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/dcp_saves.py --mode thread --save-dir /tmp/dcp

Modes: `none` (FSDP2 without saving), `thread` and `process` (`dcp.async_save` with
`AsyncCheckpointerType.THREAD` / `.PROCESS`). The model is built and wrapped as in
benchmarks/engine.py (the same units fully_shard'ed, AdamW), the batches are fsdpkit's
synthetic ones. Every `--save-every` steps the model and optimizer state (`get_state_dict`)
go to `save-dir/step-N` through DCP's FileSystemWriter (one file per rank, fsynced), on a
gloo process group of their own (on the training group the background save aborts); older
checkpoints are removed once a newer one is complete (`--keep-last 1`).

As in `fsdpkit train`: `step_tokens_per_second` counts the steps after the first;
`save_stall_s` is the time the training thread spent saving between steps (waiting for
the previous save, `get_state_dict`, and `async_save` until it returns: the staging copy, the
hand-off), the save after the last step and waiting for it excluded; the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine_systems import RunSettings, build_system, train_steps  # noqa: E402

from fsdpkit.dist.launch import LaunchOptions, launch  # noqa: E402
from fsdpkit.train.data import TokenSource  # noqa: E402

EXECUTORS = {"thread": AsyncCheckpointerType.THREAD, "process": AsyncCheckpointerType.PROCESS}


class DcpSaver:
    """At most one `dcp.async_save` in flight; the stall each save costs the calling thread."""

    def __init__(self, save_dir: Path, executor: AsyncCheckpointerType) -> None:
        self.save_dir, self.executor = save_dir, executor
        self.group = dist.new_group(backend="gloo")
        self.future = None
        self.saved: list[Path] = []
        self.stall_seconds = 0.0
        self.saves = 0

    def save(self, system, step: int) -> None:
        started = time.perf_counter()
        self.wait()
        model_state, optim_state = get_state_dict(system.model, system.optimizer)
        target = self.save_dir / f"step-{step:08d}"
        self.future = dcp.async_save(
            {"model": model_state, "optim": optim_state},
            checkpoint_id=target,
            process_group=self.group,
            async_checkpointer_type=self.executor,
        )
        self.saved.append(target)
        self.saves += 1
        self.stall_seconds += time.perf_counter() - started

    def wait(self) -> None:
        if self.future is None:
            return
        self.future.result()
        self.future = None
        if dist.get_rank() == 0:  # keep the newest: remove the older ones off this thread
            for old in self.saved[:-1]:
                threading.Thread(target=shutil.rmtree, args=(old,), kwargs={"ignore_errors": True}, daemon=True).start()
        self.saved = self.saved[-1:]


def dcp_worker(args: argparse.Namespace) -> dict:
    dist.init_process_group("gloo")
    try:
        return _train(args)
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace) -> dict:
    device = torch.device("cpu")
    settings = RunSettings(model=args.model, batch=args.batch, seq_len=args.seq_len)
    data = TokenSource("synthetic", vocab_size=resolve_model(args.model).vocab_size, seq_len=args.seq_len, seed=0)
    system = build_system("fsdp2", settings, device)
    saver = DcpSaver(Path(args.save_dir), EXECUTORS[args.mode]) if args.mode != "none" else None
    step_seconds, stall = [], 0.0
    for step in range(1, args.steps + 1):
        started = time.perf_counter()
        train_steps(system, data, settings, device, 1)
        step_seconds.append(time.perf_counter() - started)
        if saver is not None and step % args.save_every == 0:
            stall = saver.stall_seconds  # the save after the last step holds up no step
            saver.save(system, step)
    if saver is not None:
        stall = stall if args.steps % args.save_every == 0 else saver.stall_seconds
        saver.wait()
    counted = sum(step_seconds[1:])
    slowest = torch.tensor([counted, stall], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    counted, stall = slowest.tolist()
    tokens = args.batch * args.seq_len * (args.steps - 1)
    return {
        "system": "fsdp2",
        "mode": args.mode,
        "steps": args.steps,
        "global_batch_size": args.batch,
        "seq_len": args.seq_len,
        "step_tokens_per_second": tokens / counted,
        "save_stall_s": stall,
        "saves": saver.saves if saver else 0,
        "save_timings": None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("none", *EXECUTORS), default="thread")
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="global batch size (sequences)")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--save-dir", default="dcp-run")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    results = launch(dcp_worker, args, options=LaunchOptions(nproc_per_node=args.nproc_per_node))
    print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
