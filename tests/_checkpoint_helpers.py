"""Shared helpers for the checkpoint tests: build sharded checkpoints the way the engine will.

Parameters are laid out with FlatLayout (the engine's arithmetic, not the checkpoint
package's), optimizer state `optim.<state>.<param>` follows its parameter, other tensors
(buffers, scalar state) sit whole on rank 0; each rank's fragments go through
`write_rank_file`, rank 0 builds the manifest and commits.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fsdpkit.checkpoint import storage
from fsdpkit.checkpoint.manifest import build_manifest
from fsdpkit.checkpoint.placement import Placement
from fsdpkit.checkpoint.state import safetensors_dtype, tensor_bytes
from fsdpkit.checkpoint.writer import FragmentBytes, write_rank_file
from fsdpkit.layout import ElementRange, FlatLayout, even_split_ranges


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


SAMPLE_UNITS = [["h.0.attn.weight", "h.0.attn.bias", "h.0.mlp.weight"],
                ["h.1.attn.weight", "h.1.attn.bias", "h.1.mlp.weight"],
                ["wte.weight", "ln_f.weight"]]


def sample_optimizer(params: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in params.items():
        state[f"optim.exp_avg.{name}"] = torch.randn(p.shape, generator=g)
        state[f"optim.exp_avg_sq.{name}"] = torch.rand(p.shape, generator=g)
    state["optim.step"] = torch.tensor(7.0)
    return state


def sample_buffers() -> dict[str, torch.Tensor]:
    return {"attn.mask": torch.tril(torch.ones(5, 5, dtype=torch.bool)),
            "pos.ids": torch.arange(11, dtype=torch.int64),
            "counter": torch.tensor(3, dtype=torch.int32),
            "empty": torch.zeros(0, 4)}


def rank_fragments(tensors: dict[str, torch.Tensor], units: list[list[str]] | None, world_size: int) -> list[list[FragmentBytes]]:
    per_rank: list[list[FragmentBytes]] = [[] for _ in range(world_size)]
    placed: dict[str, list[tuple[int, ElementRange]]] = {}
    for unit in units or []:
        layout = FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], world_size)
        for rank in range(world_size):
            for frag in layout.fragments(rank):
                placed.setdefault(frag.name, []).append((rank, frag.param_range))
    for name, tensor in tensors.items():
        owner = name.split(".", 2)[2] if name.startswith("optim.") and name.count(".") >= 2 else None
        if name in placed:
            pieces = placed[name]
        elif owner in placed and tensors[owner].numel() == tensor.numel():
            pieces = placed[owner]
        elif units:
            pieces = [(0, ElementRange(0, tensor.numel()))]
        else:
            pieces = list(enumerate(even_split_ranges(tensor.numel(), world_size)))
        flat = tensor.reshape(-1)
        for rank, rng in pieces:
            per_rank[rank].append(FragmentBytes(name, tuple(tensor.shape), rng, safetensors_dtype(tensor.dtype),
                                                tensor_bytes(flat[rng.start:rng.end])))
    return per_rank


def save_checkpoint(run_dir: Path, step: int, tensors: dict[str, torch.Tensor], *, world_size: int,
                    units: list[list[str]] | None = None, training_state: dict | None = None,
                    aliases: dict[str, str] | None = None, keep_last: int | None = None) -> Path:
    tmp = storage.begin(run_dir, step)
    files = [write_rank_file(tmp, rank=r, world_size=world_size, fragments=frags)
               for r, frags in enumerate(rank_fragments(tensors, units, world_size))]
    placement = Placement.flat([[(n, tuple(tensors[n].shape)) for n in unit] for unit in units]) if units else Placement.even()
    manifest = build_manifest(world_size=world_size, strategy="full", placement=placement, files=files,
                              training_state=training_state or {"step": step}, aliases=aliases,
                              tensor_order=list(tensors))
    return storage.commit(tmp, run_dir, step, manifest, keep_last=keep_last)


def run_cli(*args: str):
    """Run `fsdpkit ARGS` in-process through Typer's CliRunner; returns the result."""
    from typer.testing import CliRunner

    from fsdpkit_cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def tree_snapshot(path: Path) -> dict[str, tuple[int, float]]:
    """name -> (size, mtime) of every file under path, to prove SRC is untouched."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*")) if p.is_file()}

