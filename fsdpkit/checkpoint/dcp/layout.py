"""Which DCP keys are the model and which the optimizer state, under fsdpkit's names (the
model's fqn, and `optim.<state>.<fqn>`), found by themselves in the layouts met in practice: a
plain `model.state_dict()` (every tensor at the top level); `{"model": ..., "optimizer": ...,
...}` as torchtitan and accelerate nest `get_state_dict(model, optimizer)`, other top-level
items kept apart; optimizer state as `state.<fqn>.<key>`, nested or flattened into one key
(`flatten_optimizer_state_dict`). Paths come from the default planner's `planner_data`;
without it the flattened keys are split at `model.` / `optimizer.`. `--dcp-model-key` /
`--dcp-optimizer-key` name the top-level keys instead ("" is the top level itself).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...errors import UsageError
from ..core.bytecopy import SourceTensor
from ..core.names import optim_tensor_name
from .metadata import DcpMetadata, DcpPath, flat_key

if TYPE_CHECKING:
    from .table import DcpCheckpoint


@dataclass(frozen=True)
class DcpLayout:
    model_key: str | None  # the nesting key of the model ("" at the top level; None: no model found)
    optimizer_key: str | None
    model: dict[str, str] = field(default_factory=dict)  # fsdpkit name -> DCP key
    optimizer: dict[str, str] = field(default_factory=dict)  # optim.<state>.<fqn> -> DCP key
    other: tuple[str, ...] = ()  # tensor keys that are neither


def _path_of(metadata: DcpMetadata, key: str) -> DcpPath:
    path = metadata.paths.get(key)
    if path:
        return path
    head, dot, rest = key.partition(".")
    return (head, rest) if dot and head in ("model", "optimizer") else (key,)


def _optimizer_entry(path: DcpPath) -> tuple[DcpPath, str, str] | None:
    """(prefix, fqn, state key) when `path` is optimizer state: (*prefix, "state", fqn, key) or
    (*prefix, "state.<fqn>.<key>")."""
    for i, part in enumerate(path):
        if part == "state" and len(path) == i + 3 and isinstance(path[i + 1], str) and isinstance(path[i + 2], str):
            return path[:i], str(path[i + 1]), str(path[i + 2])
        if isinstance(part, str) and part.startswith("state.") and len(path) == i + 1:
            fqn, dot, key = part[len("state.") :].rpartition(".")
            if dot and fqn:
                return path[:i], fqn, key
    return None


def detect_layout(metadata: DcpMetadata, *, model_key: str | None = None, optimizer_key: str | None = None) -> DcpLayout:
    paths = {key: _path_of(metadata, key) for key in metadata.tensors}
    entries = {key: entry for key, path in paths.items() if (entry := _optimizer_entry(path)) is not None}
    if optimizer_key is None:
        counts = Counter(flat_key(prefix) for prefix, _, _ in entries.values())
        optimizer_key = counts.most_common(1)[0][0] if counts else None
    elif not any(flat_key(prefix) == optimizer_key for prefix, _, _ in entries.values()):
        raise UsageError(f"{metadata.directory}: no optimizer state under --dcp-optimizer-key {optimizer_key!r} ({_top_keys(metadata)})")
    optimizer = {
        optim_tensor_name(state, fqn): key
        for key, (prefix, fqn, state) in entries.items()
        if flat_key(prefix) == optimizer_key and "." not in state
    }
    rest = {key: path for key, path in paths.items() if key not in optimizer.values()}
    groups: Counter[str] = Counter("" if len(path) == 1 else str(path[0]) for path in rest.values())
    if model_key is None:
        ranked = sorted(groups.items(), key=lambda item: (item[0] != "model", -item[1]))
        model_key = ranked[0][0] if ranked else None
    elif model_key not in groups:
        raise UsageError(f"{metadata.directory}: no tensors under --dcp-model-key {model_key!r} ({_top_keys(metadata)})")
    model = {}
    for key, path in rest.items():
        if model_key == "" and len(path) == 1:
            model[str(path[0])] = key
        elif model_key and len(path) > 1 and path[0] == model_key:
            model[flat_key(path[1:])] = key
    other = tuple(key for key in rest if key not in model.values())
    return DcpLayout(model_key if model else None, optimizer_key if optimizer else None, model, optimizer, other)


def _top_keys(metadata: DcpMetadata) -> str:
    paths = [_path_of(metadata, key) for key in [*metadata.tensors, *metadata.bytes_items]]
    tops = sorted({str(path[0]) for path in paths if len(path) > 1})
    return "top-level keys: " + (", ".join(tops) if tops else "none, the tensors are at the top level")


def layout_sources(checkpoint: DcpCheckpoint, layout: DcpLayout) -> tuple[list[SourceTensor], list[SourceTensor]]:
    """(model, optimizer) tensors as sources under fsdpkit's names."""
    model = [checkpoint.source(key, name) for name, key in layout.model.items()]
    optim = [checkpoint.source(key, name) for name, key in layout.optimizer.items()]
    return model, optim
