"""Checkpoints in training: what the training state holds, resuming exactly, starting from
full or sharded weights (`--init-from`), and checking a checkpoint before any process starts."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..checkpoint.compat import check_compatible
from ..checkpoint.full import is_full_checkpoint, open_full
from ..checkpoint.reader import CheckpointReader
from ..engine.checkpoint_io import Checkpointer, expected_for_plans, persistent_buffers, stateless_params
from ..engine.plan import plan_units
from ..engine.sharded import get_state
from ..errors import DataCheckError
from ..models.registry import build_model
from .model_setup import wrap_policy

if TYPE_CHECKING:
    from .config import TrainConfig
    from .loop import Trainer

OPTIMIZER_CLASS = {"adamw": "AdamW", "sgd": "SGD"}


def training_state(trainer: "Trainer") -> dict:
    """World-size independent: the data stream is a function of (seed, step), the learning
    rate of the optimizer step count; the RNG state is the same on every rank."""
    config = trainer.config
    return {
        "step": trainer.step,
        "optimizer_steps": trainer.optimizer_steps,
        "samples": trainer.step * config.global_batch_size,
        "lr_schedule": {"kind": config.lr_schedule, "position": trainer.optimizer_steps,
                        "warmup_steps": config.warmup_steps, "base_lr": config.lr,
                        "decay_steps": config.schedule_steps},
        "grad_scaler": trainer.scaler.state_dict() if trainer.scaler else None,
        "rng": {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")},
        "world_size": trainer.world_size,
        "config": config.to_json(),
    }


def apply_training_state(trainer: "Trainer", state: dict) -> None:
    trainer.step = int(state.get("step", 0))
    trainer.optimizer_steps = int(state.get("optimizer_steps", trainer.step))
    if trainer.scaler is not None and state.get("grad_scaler"):
        trainer.scaler.load_state_dict(state["grad_scaler"])
    rng = (state.get("rng") or {}).get("torch_cpu")
    if rng:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng)), dtype=torch.uint8))


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


def check_before_launch(config: "TrainConfig", path: str, *, with_optimizer: bool) -> None:
    """Validate a --resume / --init-from checkpoint against the model, on the meta device:
    any problem is a DataCheckError (exit 3) before a process starts."""
    model = build_model(config.model, device="meta")
    plans = plan_units(model, wrap_policy(config.model, config.wrap, min_params=config.wrap_min_params, every=config.wrap_every))
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in params}
    if is_full_checkpoint(Path(path)) and not with_optimizer:
        _check_full(_full_tensors(path), expected_for_plans(plans, buffers, None), path)
        return
    with CheckpointReader(path) as reader:
        optimizer_type = OPTIMIZER_CLASS.get(config.optimizer) if with_optimizer else None
        stateless = stateless_params(reader.training_state)
        check_compatible(reader.manifest, expected_for_plans(plans, buffers, optimizer_type, stateless=stateless),
                         strict=config.strict and with_optimizer, where=str(reader.step_dir))
