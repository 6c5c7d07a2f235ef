"""Where a Megatron checkpoint's parts lie (no torch): a `torch_dist` or legacy `zarr` directory
(its `metadata.json` names the backend), a NeMo 2 checkpoint (`context/` beside `weights/`, the
latter a `torch_dist` directory), or a Megatron-LM save directory whose
`latest_checkpointed_iteration.txt` names its `iter_NNNNNNN` step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataCheckError
from ..core.files import read_regular, source_path

FORMAT = "megatron"  # the format's name (`MegatronFormat.name`)
BACKEND_CONFIG = "metadata.json"
COMMON_PT = "common.pt"
COMMON_STATE_KEY = "common_state"  # 0.19: the common state as a sharded object's bytes item
INTEGRITY_NAME = "integrity.json"
NEMO_CONTEXT, NEMO_WEIGHTS, NEMO_MODEL_YAML = "context", "weights", "model.yaml"
LATEST_ITERATION = "latest_checkpointed_iteration.txt"
TORCH_DIST, ZARR = "torch_dist", "zarr"
BACKENDS = (TORCH_DIST, ZARR)


@dataclass(frozen=True)
class MegatronFiles:
    root: Path  # the directory opened (a NeMo checkpoint's top)
    weights: Path  # the torch_dist or zarr directory
    backend: str
    context: Path | None  # NeMo 2's context/, None for Megatron's own


def _step_dir(path: Path) -> Path:
    """A Megatron-LM save directory's latest `iter_*` step; any other directory itself."""
    latest = path / LATEST_ITERATION
    if not latest.is_file():
        return path
    text = read_regular(latest, 64).decode(errors="replace").strip()
    if text == "release":
        return path / "release"
    if not text.isdigit():
        raise DataCheckError(f"{latest}: holds {text[:40]!r}, not an iteration number")
    return path / f"iter_{int(text):07d}"


def find_files(path: str | os.PathLike[str]) -> MegatronFiles | None:
    """The checkpoint's parts, or None when `path` is no Megatron checkpoint (a
    `metadata.json` of another backend is a DataCheckError)."""
    path = source_path(path)
    if not path.is_dir():
        return None
    root = _step_dir(path)
    context = root / NEMO_CONTEXT if (root / NEMO_CONTEXT).is_dir() and (root / NEMO_WEIGHTS).is_dir() else None
    weights = root / NEMO_WEIGHTS if context is not None else root
    if not (weights / BACKEND_CONFIG).is_file():
        return None
    return MegatronFiles(root, weights, backend_of(weights), context)


def backend_of(weights: Path) -> str:
    raw = read_regular(weights / BACKEND_CONFIG, 1 << 16)
    try:
        document = json.loads(raw)
    except ValueError:
        raise DataCheckError(f"{weights / BACKEND_CONFIG}: not JSON") from None
    backend = document.get("sharded_backend") if isinstance(document, dict) else None
    if backend not in BACKENDS:
        raise DataCheckError(f"{weights / BACKEND_CONFIG}: sharded_backend {backend!r}, fsdpkit reads {' and '.join(BACKENDS)}")
    return backend


def is_megatron_checkpoint(path: str | os.PathLike[str]) -> bool:
    try:
        return find_files(path) is not None
    except DataCheckError:
        return True  # Megatron's, and its reader says what is wrong
