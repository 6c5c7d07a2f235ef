"""A generator of format-1 checkpoints, as fsdpkit wrote them before format 2, so the tests
prove v1 still loads, verifies, converts and reshards (no binary fixture in git).

v1 lists every fragment in the manifest: parameters of a flat plan cut by FlatLayout chunks,
`optim.<state>.<param>` like its parameter, every other tensor whole on rank 0 (an even plan:
`even_split_ranges`); rank files hold 1-D fragments under the tensor's name, written here with
the safetensors library itself.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from fsdpkit.flat_layout import ElementRange, FlatLayout, even_split_ranges

DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
    torch.uint8: "U8",
}


def write_v1(
    step_dir: Path,
    tensors: dict[str, torch.Tensor],
    *,
    world_size: int,
    units: list[list[str]] | None,
    training_state: dict,
    aliases: dict[str, str] | None = None,
) -> Path:
    step_dir.mkdir(parents=True)
    placed: dict[str, list[tuple[int, ElementRange]]] = {}
    for unit in units or []:
        layout = FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], world_size)
        for rank in range(world_size):
            for frag in layout.fragments(rank):
                if frag.param_range.size:
                    placed.setdefault(frag.name, []).append((rank, frag.param_range))
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    entries = []
    for name, tensor in tensors.items():
        owner = name.split(".", 2)[2] if name.startswith("optim.") and name.count(".") >= 2 else None
        if name in placed:
            pieces = placed[name]
        elif owner in placed and tensors[owner].numel() == tensor.numel():
            pieces = placed[owner]
        elif units:
            pieces = [(0, ElementRange(0, tensor.numel()))] if tensor.numel() else []
        else:
            pieces = [(r, rng) for r, rng in enumerate(even_split_ranges(tensor.numel(), world_size)) if rng.size]
        flat = tensor.reshape(-1)
        fragments = []
        for rank, rng in pieces:
            data = flat[rng.start : rng.end].contiguous()
            per_rank[rank][name] = data
            crc = zlib.crc32(data.view(torch.uint8).numpy().tobytes())
            fragments.append({"file": rank, "key": name, "start": rng.start, "end": rng.end, "crc32": crc})
        entries.append({"name": name, "shape": list(tensor.shape), "dtype": DTYPES[tensor.dtype], "fragments": fragments})
    files = []
    for rank in range(world_size):
        name = f"rank-{rank:05d}-of-{world_size:05d}.safetensors"
        save_file(per_rank[rank], step_dir / name, metadata={"format": "pt"})
        files.append({"name": name, "size": (step_dir / name).stat().st_size})
    plan = (
        {"kind": "even"}
        if not units
        else {
            "kind": "flat",
            "units": [
                {
                    "params": [{"name": n, "shape": list(tensors[n].shape)} for n in unit],
                    "padding": FlatLayout.from_shapes([(n, tuple(tensors[n].shape)) for n in unit], world_size).padding,
                }
                for unit in units
            ],
        }
    )
    manifest = {
        "format": "fsdpkit-checkpoint",
        "version": 1,
        "world_size": world_size,
        "strategy": "full_shard",
        "plan": plan,
        "files": files,
        "tensors": entries,
        "aliases": aliases or {},
        "training_state": training_state,
    }
    (step_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return step_dir
