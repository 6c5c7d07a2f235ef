"""The optimizer files of per-rank `torch.save` state dicts (`optim_world_size_W_rank_R.pt`, as
verl's FSDP checkpoint manager writes them): each rank's `optimizer.state_dict()`, `{"state": {index:
{"step": ..., "exp_avg": DTensor, ...}}, "param_groups": [{..., "params": [index, ...]}]}`, read
without torch. When its indices map to parameter names and when the files are not read
(`OptimizerState.not_read` says why): docs/deepspeed.md, "Per-rank torch.save state dicts (verl)".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core.bytecopy import SourceTensor
from ..core.names import optim_tensor_name
from ..torchfile import unpickler as u
from ..torchfile.savefile import SaveFile, open_each
from .tensors import FSDP1, FSDP2, sharding_of, source_tensor
from .unpickler import DTensorRecord, loads


@dataclass
class OptimizerState:
    tensors: list[SourceTensor] = field(default_factory=list)  # optim.<state>.<param name>
    param_groups: list[dict[str, Any]] = field(default_factory=list)  # each group's settings, without its "params"
    not_read: str = ""  # why optimizer files that are there are not read ("" when read, or when there are none)
    opened: list[SaveFile] = field(default_factory=list)


def open_optimizer(directory: Path, world_size: int, model_state: dict[str, Any], model: list[SourceTensor]) -> OptimizerState:
    """The optimizer files beside the model files of `world_size` ranks (`model_state`: rank 0's
    model file, unpickled), read where their indices map to the model's parameter names."""
    paths = [directory / f"optim_world_size_{world_size}_rank_{rank}.pt" for rank in range(world_size)]
    present = [path.exists() for path in paths]
    if not any(present):
        return OptimizerState()
    if not all(present):
        return OptimizerState(not_read=f"optimizer files of ranks {[r for r, p in enumerate(present) if p]} of {world_size} only")
    sharding = sharding_of(model_state.values())
    if sharding != FSDP2:
        why = "FSDP1's is kept as shards of flat parameters" if sharding == FSDP1 else "no model tensor is a DTensor"
        return OptimizerState(not_read=f"the optimizer state is keyed by parameter index, not name, and {why}")
    opened: list[SaveFile] = []
    found = OptimizerState(not_read="not opened")
    try:
        open_each(paths, lambda _, path: SaveFile(path, loads), opened)
        found = _read(opened, [name for name, record in model_state.items() if isinstance(record, DTensorRecord)], model)
    finally:
        if found.not_read:  # kept open only when read
            for rank_file in opened:
                rank_file.close()
    found.opened = [] if found.not_read else opened
    return found


def _groups(state: Any) -> list[dict[str, Any]] | None:
    """The param groups of an `optimizer.state_dict()`, or None where it is not one."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or not isinstance(state.get("param_groups"), list):
        return None
    groups = state["param_groups"]
    return groups if all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups) else None


def _read(files: list[SaveFile], parameters: list[str], model: list[SourceTensor]) -> OptimizerState:
    states = [rank_file.state for rank_file in files]
    groups = [_groups(state) for state in states]
    if any(g is None for g in groups):
        return OptimizerState(not_read="not an optimizer.state_dict() ({'state': ..., 'param_groups': [...]})")
    first = groups[0] or []
    if len(first) != 1:
        return OptimizerState(not_read=f"{len(first)} param groups: the file does not say which parameter each index is")
    indices = first[0]["params"]
    if len(indices) != len(parameters):
        why = f"its param group lists {len(indices)} parameters, the model file holds {len(parameters)} DTensors"
        return OptimizerState(not_read=why)
    shapes = {source.name: tuple(source.shape) for source in model}
    tensors = []
    for index, name in zip(indices, parameters, strict=True):
        per_rank = [state["state"].get(index) for state in states]
        if not isinstance(per_rank[0], dict):
            continue  # no state (a frozen parameter)
        for key, value in per_rank[0].items():
            if not isinstance(value, (u.TensorRecord, DTensorRecord)):
                continue
            records = [entry.get(key) if isinstance(entry, dict) else None for entry in per_rank]
            tensor = source_tensor(optim_tensor_name(str(key), name), files, records)
            if tensor.shape and tuple(tensor.shape) != shapes[name]:  # a moment is shaped as its parameter; step is a scalar
                why = f"state {key!r} of index {index} has shape {list(tensor.shape)}, parameter {name!r} {list(shapes[name])}"
                return OptimizerState(not_read=why)
            tensors.append(tensor)
    return OptimizerState(tensors, [{k: v for k, v in group.items() if k != "params"} for group in first])
