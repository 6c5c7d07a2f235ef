"""Does a checkpoint copied to the host while training goes on hold the step it names, bitwise?
On a GPU, the copy (copy_order.py) runs on its own CUDA stream while the next steps run on the
training stream; a wait in the wrong direction would let the next optimizer step change a
parameter before it was copied. One process: a GPT sharded by fsdpkit with AdamW trains, the
state of step N (parameters, buffers, AdamW's moments: this rank's tensor table) is cloned
synchronously, then an async save (`Checkpointer(async_save=True)`) and an in-memory snapshot
(`SnapshotWriter`, its store in a temporary directory) of step N are started and
`--steps-after` more steps run before they are waited for. What each wrote, read back, must
equal the clone bitwise, and the steps after must have changed the live tensors.

    .venv/bin/python benchmarks/snapshot_check.py --device cuda --json   # benchmarks/gpu_check.sh runs it
    .venv/bin/python benchmarks/snapshot_check.py --device cpu --n-embd 64 --n-layer 2

The exit status is 1 when a save does not hold its step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdpkit
from fsdpkit.checkpoint.live.model_state import tensor_table
from fsdpkit.checkpoint.live.tensors import CheckpointReader
from fsdpkit.checkpoint.memory.store import SnapshotStore
from fsdpkit.checkpoint.memory.writer import SnapshotWriter
from fsdpkit.engine.view import describe
from fsdpkit.models.gpt import GPT, Block, GPTConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--step", type=int, default=3, help="the step saved")
    parser.add_argument("--steps-after", type=int, default=3, help="steps run while the copies are in flight")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device) -> None:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 512, (4, 129), generator=generator).to(device)
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[Any, torch.Tensor]]:
    """This rank's tensor table as host copies taken now, synchronously."""
    _, local = tensor_table(describe(model), model, optimizer)
    return {name: (held, data.detach().to("cpu", copy=True)) for name, (held, data) in local.items()}


def _compare(step_dir: Path, expected: dict, live: dict) -> dict[str, Any]:
    with CheckpointReader(step_dir, validate_all=False) as reader:
        wrong = [name for name, (held, data) in expected.items() if not torch.equal(reader.read_range(name, held), data)]
    changed = sum(not torch.equal(live[name][1], data) for name, (_, data) in expected.items())
    return {"tensors": len(expected), "bitwise_equal": not wrong, "wrong": wrong[:5], "changed_after": changed}


def check(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=128, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64), n_embd=args.n_embd)
    model = fsdpkit.shard(GPT(config), wrap=(Block,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saver = fsdpkit.Checkpointer(model, optimizer, async_save=True)
    store = SnapshotStore.create(root, run_id="snapshot-check", node_rank=0)
    writer = SnapshotWriter(store, model, optimizer, peers=None, warn=lambda line: print(line, file=sys.stderr))
    for step in range(1, args.step + 1):
        _step(model, optimizer, step, device)
    expected = _state(model, optimizer)
    saver.save(root / "saves", step=args.step)
    writer.offer(args.step, {})
    for step in range(args.step + 1, args.step + 1 + args.steps_after):
        _step(model, optimizer, step, device)
    saver.wait()
    writer.wait()
    live = _state(model, optimizer)
    return {
        "device": str(device),
        "step": args.step,
        "async_save": _compare(next((root / "saves").glob("step-*")), expected, live),
        "snapshot": _compare(store.step_dir(args.step), expected, live),
    }


def main() -> None:
    args = parse_args()
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory(prefix="snapshot-check-") as root:
            result = check(args, Path(root))
    finally:
        dist.destroy_process_group()
    held = all(result[kind]["bitwise_equal"] and result[kind]["changed_after"] for kind in ("async_save", "snapshot"))
    result["holds_its_step"] = held
    if args.json:
        print(json.dumps(result))
    else:
        for kind in ("async_save", "snapshot"):
            r = result[kind]
            print(
                f"{kind}: step {result['step']} on {result['device']}: {r['tensors']} tensors, bitwise equal {r['bitwise_equal']}, "
                f"{r['changed_after']} changed by the steps after {r['wrong'] or ''}"
            )
    sys.exit(0 if held else 1)


if __name__ == "__main__":
    main()
