"""Shared helpers for the checkpoint tests: build sharded checkpoints the way training does.

`save_checkpoint` writes every rank's file with the same function a training rank uses
(`state.write_rank`: the layout derived from the manifest, each rank's bytes from its own
data), then commits as rank 0 does. `tests/support/checkpoint_v1.py` writes the old format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdpkit.checkpoint.format import storage
from fsdpkit.checkpoint.format.manifest import Manifest
from fsdpkit.checkpoint.format.placement import Placement, TensorSpec
from fsdpkit.checkpoint.live.save_protocol import write_rank
from fsdpkit.checkpoint.live.tensors import safetensors_dtype
from fsdpkit.flat_layout import ElementRange


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "wte.weight": torch.randn(17, 8, generator=g),
        "h.0.attn.weight": torch.randn(8, 8, generator=g),
        "h.0.attn.bias": torch.randn(8, generator=g),
        "h.0.mlp.weight": torch.randn(3, 8, 5, generator=g),
        "h.1.attn.weight": torch.randn(8, 8, generator=g),
        "h.1.attn.bias": torch.randn(8, generator=g),
        "h.1.mlp.weight": torch.randn(3, 8, 5, generator=g),
        "ln_f.weight": torch.randn(7, generator=g),
    }


SAMPLE_UNITS = [
    ["h.0.attn.weight", "h.0.attn.bias", "h.0.mlp.weight"],
    ["h.1.attn.weight", "h.1.attn.bias", "h.1.mlp.weight"],
    ["wte.weight", "ln_f.weight"],
]


def sample_optimizer(params: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in params.items():
        state[f"optim.exp_avg.{name}"] = torch.randn(p.shape, generator=g)
        state[f"optim.exp_avg_sq.{name}"] = torch.rand(p.shape, generator=g)
    state["optim.step"] = torch.tensor(7.0)
    return state


def sample_buffers() -> dict[str, torch.Tensor]:
    return {
        "attn.mask": torch.tril(torch.ones(5, 5, dtype=torch.bool)),
        "pos.ids": torch.arange(11, dtype=torch.int64),
        "counter": torch.tensor(3, dtype=torch.int32),
        "empty": torch.zeros(0, 4),
    }


def make_manifest(
    tensors: dict[str, torch.Tensor],
    *,
    world_size: int,
    units: list[list[str]] | None = None,
    training_state: dict | None = None,
    aliases: dict[str, str] | None = None,
    run_id: str = "test-run",
) -> Manifest:
    placement = Placement.flat([[(n, tuple(tensors[n].shape)) for n in unit] for unit in units]) if units else Placement.even()
    table = tuple(TensorSpec(n, safetensors_dtype(t.dtype), tuple(t.shape)) for n, t in tensors.items())
    return Manifest(world_size, "full", placement, table, dict(aliases or {}), dict(training_state or {}), run_id)


def write_ranks(directory: Path, manifest: Manifest, tensors: dict[str, torch.Tensor]) -> None:
    """Every rank's file, each written from data that holds the whole tensors."""
    whole = {n: (ElementRange(0, t.numel()), t.reshape(-1)) for n, t in tensors.items()}
    for rank in range(manifest.shard_factor):
        write_rank(directory, manifest, rank, whole)


def save_checkpoint(
    run_dir: Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    *,
    world_size: int,
    units: list[list[str]] | None = None,
    training_state: dict | None = None,
    aliases: dict[str, str] | None = None,
    keep_last: int | None = None,
    run_id: str = "test-run",
) -> Path:
    manifest = make_manifest(
        tensors, world_size=world_size, units=units, aliases=aliases, training_state=training_state or {"step": step}, run_id=run_id
    )
    tmp = storage.begin(run_dir, step, run_id=run_id)
    write_ranks(tmp, manifest, tensors)
    return storage.commit(tmp, run_dir, step, manifest, keep_last=keep_last)


def run_cli(*args: str):
    """Run `fsdpkit ARGS` in-process through Typer's CliRunner; returns the result."""
    from fsdpkit_cli.app import app
    from typer.testing import CliRunner

    return CliRunner().invoke(app, [str(a) for a in args])


def tree_snapshot(path: Path) -> dict[str, tuple[int, float]]:
    """name -> (size, mtime) of every file under path, to prove SRC is untouched."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}
