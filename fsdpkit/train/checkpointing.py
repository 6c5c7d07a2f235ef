"""Checkpoints in training: starting from full or sharded weights (`--init-from`), and checking
a checkpoint before any process starts. (What the training state holds is the Trainer's.)"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.compat import check_compatible
from ..checkpoint.full import is_full_checkpoint, open_full
from ..checkpoint.reader import CheckpointReader
from ..engine.checkpoint_io import Checkpointer, expected_for_plans, persistent_buffers, stateless_params
from ..engine.plan import WrapPolicy, plan_units
from ..engine.sharded import get_state
from ..errors import DataCheckError
from ..models.registry import build_model

OPTIMIZER_CLASS = {"adamw": "AdamW", "sgd": "SGD"}


def init_weights_from(model: torch.nn.Module, path: str) -> None:
    """Load weights only, from a sharded checkpoint or a full (Hugging Face style) one."""
    if is_full_checkpoint(Path(path)):
        _load_full(model, path)
    else:
        Checkpointer(model, None).load(path, strict=False)


def _full_tensors(path: str) -> dict:
    """A full checkpoint's tensors by name, tied aliases resolved to their stored tensor."""
    full = open_full(path)
    tensors = {t.name: t for t in full.tensors}
    for alias, stored in full.aliases.items():
        tensors.setdefault(alias, tensors.get(stored))
    return tensors


def _load_full(model: torch.nn.Module, path: str) -> None:
    tensors = _full_tensors(path)
    state = get_state(model)
    expected = expected_for_plans([u.plan for u in state.units], {n: tuple(t.shape) for n, t in persistent_buffers(model).items()}, None)
    _check_full(tensors, expected, path)
    with torch.no_grad():
        for unit in state.units:
            for fragment, param, plan in zip(unit.fragments, unit.params, unit.plan.params):
                if fragment.param_range.size:
                    param.copy_(_read_full_range(tensors[plan.name], fragment.param_range.start, fragment.param_range.end).to(param.dtype))
        for name, buffer in persistent_buffers(model).items():
            buffer.copy_(_read_full_range(tensors[name], 0, buffer.numel()).reshape(buffer.shape).to(buffer.dtype))


def _check_full(tensors: dict, expected: dict, path: str) -> None:
    for name, shape in expected.items():
        if name not in tensors or tensors[name] is None:
            raise DataCheckError(f"{path}: no tensor {name!r} (a checkpoint of another model?)")
        if tuple(tensors[name].shape) != tuple(shape):
            raise DataCheckError(f"{path}: tensor {name!r} has shape {list(tensors[name].shape)}, the model {list(shape)}")


def _read_full_range(source, start: int, end: int) -> torch.Tensor:
    from ..checkpoint.format import dtype_info
    from ..checkpoint.writer import SAFETENSORS_TO_TORCH

    itemsize = dtype_info(source.dtype).itemsize
    piece = source.pieces[0]
    with open(piece.path, "rb") as handle:
        handle.seek(piece.offset + start * itemsize)
        data = handle.read((end - start) * itemsize)
    if len(data) != (end - start) * itemsize:
        raise DataCheckError(f"{piece.path}: truncated while reading {source.name!r}")
    return torch.frombuffer(bytearray(data), dtype=SAFETENSORS_TO_TORCH[source.dtype])


def check_before_launch(path: str, *, model_name: str, policy: WrapPolicy, optimizer: str | None, strict: bool) -> None:
    """Validate a --resume (optimizer: its name) or --init-from (optimizer None) checkpoint
    against the model, on the meta device: any problem is a DataCheckError (exit 3) before a
    process starts."""
    model = build_model(model_name, device="meta")
    plans = plan_units(model, policy)
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in params}
    if is_full_checkpoint(Path(path)) and optimizer is None:
        _check_full(_full_tensors(path), expected_for_plans(plans, buffers, None), path)
        return
    with CheckpointReader(path) as reader:
        optimizer_type = OPTIMIZER_CLASS.get(optimizer) if optimizer else None
        stateless = stateless_params(reader.training_state)
        check_compatible(reader.manifest, expected_for_plans(plans, buffers, optimizer_type, stateless=stateless),
                         strict=strict and optimizer is not None, where=str(reader.step_dir))
