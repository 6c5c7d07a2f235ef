"""Saving and loading a sharded model and its optimizer in the fsdpkit checkpoint format
(docs/checkpoint-format.md): every rank writes only what it owns, no gather to rank 0;
loading reads, for each local chunk, the overlapping fragments from whichever files hold
them, so a checkpoint saved at W ranks loads at any W' and under any strategy.

Optimizer state tensors are `optim.<state>.<param name>`, fragmented like their parameter;
scalar state (Adam's step) is stored once, by rank 0. Tied weights are stored once with
their alias recorded. With hybrid or no sharding, only the first replica writes.
"""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..checkpoint import commit as commit_ops
from ..checkpoint.compat import check_compatible
from ..checkpoint.manifest import build_manifest
from ..checkpoint.plan import Plan
from ..checkpoint.reader import CheckpointReader
from ..checkpoint.writer import FragmentData, write_rank_file
from ..errors import DataCheckError, RunError
from ..layout import ElementRange
from .plan import UnitPlan
from .sharded import ShardedState, get_state

OPTIMIZER_STATE_KEYS = {"AdamW": ("exp_avg", "exp_avg_sq", "step"), "Adam": ("exp_avg", "exp_avg_sq", "step")}


def _optimizer_name(key: str, param_name: str) -> str:
    return f"optim.{key}.{param_name}"


def aliases_of(state: ShardedState) -> dict[str, str]:
    """Tied weights: every further name of a parameter -> its stored (canonical) name."""
    aliases = {}
    for unit in state.units:
        for plan in unit.plan.params:
            for module_name, attr in plan.uses:
                name = f"{module_name}.{attr}" if module_name else attr
                if name != plan.name:
                    aliases[name] = plan.name
    return aliases


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {name: tensor for name, tensor in module.state_dict().items() if name not in params and "." + name not in params}


def expected_tensors(module: nn.Module, optimizer: torch.optim.Optimizer | None, *, stateless: set[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must have to load into `module` (and `optimizer`): names to shapes."""
    state = get_state(module)
    buffers = {name: tuple(t.shape) for name, t in persistent_buffers(module).items()}
    return expected_for_plans([unit.plan for unit in state.units], buffers, type(optimizer).__name__ if optimizer is not None else None,
                              stateless=stateless)


def stateless_params(training_state: dict) -> set[str]:
    """Trainable parameters the saved optimizer held no state for (it never stepped them)."""
    return set((training_state.get("optimizer") or {}).get("stateless", []))


def expected_for_plans(plans: list[UnitPlan], buffers: dict[str, tuple[int, ...]], optimizer_type: str | None,
                       *, stateless: set[str] = frozenset()) -> dict[str, tuple[int, ...]]:
    """The same from unit plans (works on a model built on the meta device, before launch).
    `stateless`: parameters whose optimizer state the checkpoint rightly lacks."""
    expected: dict[str, tuple[int, ...]] = {}
    for plan in plans:
        for param in plan.params:
            expected[param.name] = tuple(param.shape)
    expected.update(buffers)
    for key in OPTIMIZER_STATE_KEYS.get(optimizer_type or "", ()):
        for plan in plans:
            for param in plan.params:
                if param.requires_grad and param.name not in stateless:
                    expected[_optimizer_name(key, param.name)] = () if key == "step" else tuple(param.shape)
    return expected


def _local_fragments(state: ShardedState, module: nn.Module, optimizer: torch.optim.Optimizer | None, *, copy: bool) -> list[FragmentData]:
    take = (lambda t: t.detach().to("cpu", copy=True)) if copy else (lambda t: t.detach())
    fragments = []
    rank0 = state.mesh.rank == 0
    for unit in state.units:
        for fragment, param, plan in zip(unit.fragments, unit.params, unit.plan.params):
            shape = tuple(plan.shape)
            fragments.append(FragmentData(plan.name, shape, fragment.param_range, take(param)))
            param_state = optimizer.state.get(param, {}) if optimizer is not None else {}
            for key, value in param_state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if value.shape == param.shape and value.dim() == 1:
                    fragments.append(FragmentData(_optimizer_name(key, plan.name), shape, fragment.param_range, take(value)))
                elif value.numel() == 1 and rank0:
                    fragments.append(FragmentData(_optimizer_name(key, plan.name), tuple(value.shape), ElementRange(0, 1), take(value).reshape(1)))
    if rank0:
        for name, tensor in persistent_buffers(module).items():
            fragments.append(FragmentData(name, tuple(tensor.shape), ElementRange(0, tensor.numel()), take(tensor).reshape(-1)))
    return fragments


def optimizer_hyperparameters(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    if optimizer is None:
        return None
    names = {id(p): name for name, p in module.named_parameters()}
    stateless = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    groups = []
    for group in optimizer.param_groups:
        settings = {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()
                    if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))}
        groups.append({"settings": settings, "params": [names.get(id(p), "?") for p in group["params"]]})
    return {"type": type(optimizer).__name__, "groups": groups, "stateless": stateless}


class Checkpointer:
    """Saves and loads one sharded model with its optimizer. With async_save, a background
    thread writes while training goes on; at most one save is in flight, and the next save
    (or wait()) waits for it. Every rank must call save/load/wait."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, async_save: bool = False) -> None:
        self.module = module
        self.optimizer = optimizer
        self.state = get_state(module)
        self.async_save = async_save
        # background saves coordinate on their own group, so they never interleave with training's collectives
        self.group = dist.new_group(backend="gloo") if async_save else self.state.mesh.group
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_saved: str | None = None

    # ----- saving
    def save(self, run_dir: str | os.PathLike, *, step: int, training_state: dict | None = None, keep_last: int | None = None) -> None:
        self.wait()
        mesh = self.state.mesh
        writes = mesh.is_replica_leader
        fragments = _local_fragments(self.state, self.module, self.optimizer, copy=self.async_save) if writes else []
        state = dict(training_state or {})
        state["optimizer"] = optimizer_hyperparameters(self.module, self.optimizer)
        job = (Path(run_dir), step, fragments, state, keep_last, writes)
        if self.async_save:
            self.thread = threading.Thread(target=self._run_save, args=job, name="fsdpkit-async-save", daemon=True)
            self.thread.start()
        else:
            self._save(*job)

    def _run_save(self, *job: Any) -> None:
        try:
            self._save(*job)
        except BaseException as error:  # re-raised in the training thread by wait()
            self.error = error

    def _save(self, run_dir: Path, step: int, fragments: list[FragmentData], state: dict, keep_last: int | None, writes: bool) -> None:
        mesh = self.state.mesh
        holder = [str(commit_ops.begin(run_dir, step)) if mesh.rank == 0 else None]
        dist.broadcast_object_list(holder, src=dist.get_global_rank(self.group, 0), group=self.group)
        tmp = Path(holder[0])
        device = torch.device("cpu") if self.async_save else self.state.device  # NCCL groups reduce device tensors
        visible = torch.tensor([1 if tmp.is_dir() else 0], device=device)
        dist.all_reduce(visible, op=dist.ReduceOp.MIN, group=self.group)
        if not visible.item():
            if mesh.rank == 0:
                commit_ops.abort(tmp)
            raise RunError(f"save directory {tmp} is not visible to every rank: --save-dir must be on a filesystem every node sees")
        record = write_rank_file(tmp, rank=mesh.shard_rank, world_size=mesh.shard_factor, fragments=fragments) if writes else None
        records: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(records, record, group=self.group)
        if mesh.rank == 0:
            written = sorted((r for r in records if r is not None), key=lambda r: r["file"])
            manifest = build_manifest(
                world_size=mesh.shard_factor, strategy=self.state.config.strategy,
                plan=Plan.flat([[(p.name, p.shape) for p in unit.plan.params] for unit in self.state.units]),
                records=written, training_state=state, aliases=aliases_of(self.state),
            )
            final = commit_ops.commit(tmp, run_dir, step, manifest, keep_last=keep_last)
            self.last_saved = str(final)
        done = [self.last_saved]
        dist.broadcast_object_list(done, src=dist.get_global_rank(self.group, 0), group=self.group)
        self.last_saved = done[0]

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    # ----- loading
    def load(self, path: str | os.PathLike, *, strict: bool = True) -> dict:
        """Load weights (and optimizer state) from a checkpoint saved at any world size;
        returns its training state. Every chunk's fragments are checksum-verified as read."""
        with CheckpointReader(path) as reader:
            stateless = stateless_params(reader.training_state)
            expected = expected_tensors(self.module, self.optimizer, stateless=stateless)
            missing_optim = check_compatible(reader.manifest, expected, strict=strict, where=str(reader.step_dir))
            if missing_optim and self.state.mesh.rank == 0:
                warnings.warn(f"{reader.step_dir}: no optimizer state for {len(missing_optim)} tensors; starting it fresh")
            with torch.no_grad():
                for unit in self.state.units:
                    for fragment, param, plan in zip(unit.fragments, unit.params, unit.plan.params):
                        if fragment.param_range.size:
                            param.copy_(reader.read_range(plan.name, fragment.param_range))
                for name, tensor in persistent_buffers(self.module).items():
                    tensor.copy_(reader.read_tensor(name).to(tensor.dtype))
            if self.optimizer is not None and not missing_optim:
                self._load_optimizer(reader)
            return reader.training_state

    def _load_optimizer(self, reader: CheckpointReader) -> None:
        stored = set(reader.tensor_names())
        for unit in self.state.units:
            for fragment, param, plan in zip(unit.fragments, unit.params, unit.plan.params):
                if not plan.requires_grad:
                    continue
                param_state = {}
                for key in OPTIMIZER_STATE_KEYS.get(type(self.optimizer).__name__, ()):
                    name = _optimizer_name(key, plan.name)
                    if name not in stored:
                        continue
                    entry = reader.tensor(name)
                    if key == "step" or entry.shape != tuple(plan.shape):
                        param_state[key] = reader.read_tensor(name).to(torch.float32).reshape(())
                    else:
                        param_state[key] = reader.read_range(name, fragment.param_range).to(param.device)
                if param_state:
                    self.optimizer.state[param] = param_state
                else:
                    self.optimizer.state.pop(param, None)
        saved = (reader.training_state.get("optimizer") or {}).get("groups") or []
        for group, saved_group in zip(self.optimizer.param_groups, saved):
            for key, value in saved_group.get("settings", {}).items():
                if key in group and key != "lr":
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value


def save(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, step: int = 0,
         training_state: dict | None = None, keep_last: int | None = None) -> str:
    """Save a sharded checkpoint into run directory `path` as step-<step>; returns its path."""
    checkpointer = Checkpointer(module, optimizer)
    checkpointer.save(path, step=step, training_state=training_state, keep_last=keep_last)
    return checkpointer.last_saved


def load(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load a checkpoint (run directory or step directory) saved at any world size."""
    return Checkpointer(module, optimizer).load(path, strict=strict)
