"""`fsdpkit inspect`: what a checkpoint holds, as a JSON-able dict (headers only, no data read).

Sharded: format and version, world size, strategy, placement kind and units, step and samples
(from the training state), the training run's settings, tensor counts and bytes for the model
and the optimizer, dtypes, the largest tensors, files with sizes, tied-weight aliases. Full
checkpoints: files (the optimizer's too, when an export has them), tensors, bytes, dtypes,
largest tensors. Invalid checkpoints raise `DataCheckError`.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ..format import FORMAT_NAME, MANIFEST_NAME, OPTIM_INDEX, OPTIM_SINGLE, dtype_info, is_optimizer_tensor, numel
from ..reader import is_full_checkpoint, open_full, open_sharded

LARGEST = 5


def _tensor_stats(items: list[tuple[str, str, tuple[int, ...]]]) -> dict:
    def size(item):
        return numel(item[2]) * dtype_info(item[1]).itemsize

    model = [i for i in items if not is_optimizer_tensor(i[0])]
    optim = [i for i in items if is_optimizer_tensor(i[0])]
    largest = sorted(items, key=size, reverse=True)[:LARGEST]
    return {
        "model": {"tensors": len(model), "bytes": sum(map(size, model)), "elements": sum(numel(i[2]) for i in model)},
        "optimizer": {"tensors": len(optim), "bytes": sum(map(size, optim))},
        "dtypes": dict(Counter(i[1] for i in items)),
        "largest": [{"name": n, "dtype": d, "shape": list(s), "bytes": size((n, d, s))} for n, d, s in largest],
    }


def summarize(path: str | Path) -> dict:
    path = Path(path)
    if path.exists() and is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists()):
        root = path if path.is_dir() else path.parent
        full = open_full(path, with_optimizer=(root / OPTIM_SINGLE).exists() or (root / OPTIM_INDEX).exists())
        summary: dict[str, Any] = {
            "path": str(path),
            "format": "safetensors-full",
            "files": [{"name": f.name, "size": f.stat().st_size} for f in full.files],
            "aliases": full.aliases,
        }
        summary.update(_tensor_stats([(t.name, t.dtype, t.shape) for t in full.tensors]))
        return summary
    checkpoint = open_sharded(path)
    manifest = checkpoint.manifest
    state = manifest.training_state
    files = [checkpoint.rank_file(index) for index in range(len(checkpoint.file_names()))]
    summary = {
        "path": str(checkpoint.step_dir),
        "format": FORMAT_NAME,
        "version": manifest.version,
        "world_size": manifest.world_size,
        "strategy": manifest.strategy,
        "placement": manifest.placement.kind,
        "units": len(manifest.placement.units),
        "step": state.get("step"),
        "samples": state.get("samples"),
        "config": state.get("config"),  # the training run's settings (fsdpkit train), if it recorded them
        "fragments": sum(len(f) for f in files),
        "files": [{"name": f.path.name, "size": f.size} for f in files],
        "aliases": manifest.aliases,
    }
    summary.update(_tensor_stats([(t.name, t.dtype, t.shape) for t in manifest.tensors]))
    return summary
