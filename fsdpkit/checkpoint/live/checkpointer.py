"""Saving and loading one sharded model with its optimizer: the `Checkpointer`, the functions
built on it, starting from a checkpoint's weights, and the check before launch. Every rank builds
the same manifest; a load reads only the files that hold its fragments, so a checkpoint saved at
W ranks loads at any W' and under any strategy (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn as nn

from ... import log
from ...dist.comm import Collectives, new_group
from ...engine.model_hooks import hooks_of
from ...engine.view import ShardedModelView, describe
from ...errors import DataCheckError
from ...holder import process_identity, run_id_of
from ..core.export import EXPORT_STATE_KEY
from ..core.files import source_path
from ..format.manifest import Manifest, check_compatible
from ..format.placement import Placement, TensorSpec
from ..format.reader import is_full_checkpoint
from ..format.run_store import stored_checkpoint
from ..storage.location import is_url
from .copy_order import DoneEvent, Event, HostBuffers, OverlappedCopy
from .model_state import expected_tensors, load_weights, optimizer_hyperparameters, persistent_buffers, tensor_table, view_params
from .optim_state import StateLayout, load_optimizer_state, states_to_load
from .replica_reads import shared_load
from .save_protocol import Ranks, SaveJob, SaveTimings, run_save
from .tensors import CheckpointReader, RangeReader, TensorReader, full_reader

BACKGROUND_NICENESS = 10


class Checkpointer:
    """Saves and loads one sharded model with its optimizer; every rank must call save/load/wait.
    With async_save, save() queues the copy into `host_buffers` (copy_order.py) and returns; a
    thread writes from there, one save at a time (docs/checkpoints.md). `run_id` names the run that
    writes (pass `RunLock.run_id`, so that a restarted worker counts as the same run): `keep_last`
    prunes only this run's checkpoints."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, async_save: bool = False, run_id: str | None = None
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        view = describe(module)
        self.async_save = async_save
        # background saves coordinate on their own group, so they never interleave with training's collectives
        group = new_group(backend="gloo") if async_save else view.group
        self.ranks = Ranks(Collectives(), group, view.rank)
        self.run_id = run_id or run_id_of(process_identity())  # only rank 0's is ever written
        self.started = datetime.now(UTC)  # no upload of this process's saves began before it
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_saved: str | None = None
        self.copy = OverlappedCopy.reserved(view, module, optimizer) if async_save and view.writes_shards else None
        self.host_buffers = self.copy.buffers if self.copy is not None else HostBuffers()
        self.timings = SaveTimings()
        self.stall_seconds = 0.0
        self.in_flight: int | None = None  # the step of the async save being written

    def save(self, run_dir: str | os.PathLike, *, step: int, training_state: dict | None = None, keep_last: int | None = None) -> None:
        started = time.perf_counter()
        held_up = self.thread is not None and self.thread.is_alive()
        self.wait()
        if held_up and self.ranks.rank == 0:
            log.warn(
                f"save of step {step} stalled training {time.perf_counter() - started:.2f} s: "
                f"the async save of step {self.in_flight} was still being written"
            )
        started = time.perf_counter()
        try:
            view = describe(self.module)
            table, local = tensor_table(view, self.module, self.optimizer)
            copied: Event = DoneEvent()
            if self.copy is not None:
                copying = time.perf_counter()
                buffers = frozenset(persistent_buffers(self.module))
                snapshot, copied = self.copy.start({name: data for name, (_, data) in local.items()}, on_training=buffers)
                if self.optimizer is None:
                    copied.synchronize()  # no optimizer step waits for the copy: nothing else guards the parameters
                local = {name: (held, snapshot[name]) for name, (held, _) in local.items()}
                seconds = time.perf_counter() - copying
                self.timings.snapshot += seconds
                self.timings.total += seconds
            manifest = manifest_of(view, self.module, self.optimizer, table, training_state, self.run_id, step)
            device = torch.device("cpu") if self.async_save else view.device  # NCCL groups reduce device tensors
            location = str(run_dir).rstrip("/") if is_url(run_dir) else Path(run_dir)
            job = SaveJob(view.shard_rank, location, step, manifest, local if view.writes_shards else None, keep_last, device, self.started)
            if self.async_save:
                self.in_flight = step
                self.thread = threading.Thread(target=self._run_save, args=(job, copied), name="fsdpkit-async-save", daemon=True)
                self.thread.start()
            else:
                self._save(job)
        finally:
            self.stall_seconds += time.perf_counter() - started

    def _run_save(self, job: SaveJob, copied: Event) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux applies setpriority to one thread by its id; elsewhere it keeps its own
            thread = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICENESS))
        try:
            copied.synchronize()
            self._save(job)
        except BaseException as error:  # re-raised in the training thread by wait()
            self.error = error

    def _save(self, job: SaveJob) -> None:
        started = time.perf_counter()
        try:
            self.last_saved = run_save(job, self.ranks, self.timings)
        finally:
            self.timings.saves += 1
            self.timings.total += time.perf_counter() - started

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        started = time.perf_counter()
        try:
            if self.thread is not None:
                self.thread.join()
                self.thread = None
            if self.error is not None:
                error, self.error = self.error, None
                raise error
        finally:
            self.stall_seconds += time.perf_counter() - started

    def load(self, path: str | os.PathLike, *, strict: bool = True, every_replica: bool = False) -> dict:
        """Load weights (and optimizer state) from a checkpoint saved at any world size; returns
        its training state. With replicas, the first reads and broadcasts to the others
        (replica_reads.py), unless `every_replica` (a store on each node: snapshots)."""
        view = describe(self.module)
        with CheckpointReader(checkpoint_path(path), validate_all=False) as checkpoint:
            names = {id(p.tensor): p.name for unit in view.units for p in unit.params}
            states, missing_optim = check_sharded(
                checkpoint.manifest, str(checkpoint.step_dir), view_params(view), self.module, self.optimizer, names, strict=strict
            )
            if missing_optim and view.rank == 0:
                log.warn(f"{checkpoint.step_dir}: no optimizer state for {len(missing_optim)} tensors; theirs starts fresh")

            def load(reader: RangeReader) -> None:
                load_weights(view, self.module, reader)
                if self.optimizer is not None and states is not None:
                    params = [(p.name, p.fragment.param_range, p.tensor) for unit in view.units for p in unit.params if p.requires_grad]
                    stored = set(checkpoint.tensor_names())
                    load_optimizer_state(self.optimizer, params, states, checkpoint.training_state, stored, reader)

            if every_replica or view.replicate_group is None:
                load(checkpoint)
            else:
                shared_load(checkpoint, view, Collectives(), load)
            return checkpoint.training_state


def manifest_of(
    view: ShardedModelView,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    table: list[TensorSpec],
    training_state: dict | None,
    run_id: str,
    step: int,
) -> Manifest:
    """The manifest every rank builds the same for a save of `table` (from `tensor_table`) at `step`."""
    state = dict(training_state or {})
    state["step"] = step  # what inspect shows and a resumed run continues from
    state["optimizer"] = optimizer_hyperparameters(module, optimizer)
    export = hooks_of(module).export  # how convert hands it to transformers (export.py)
    if export is not None:
        state[EXPORT_STATE_KEY] = export.to_json()
    return Manifest(
        view.shard_factor,
        view.strategy,
        Placement.flat([[(p.name, p.shape) for p in unit.params] for unit in view.units]),
        tuple(table),
        {alias: p.name for unit in view.units for p in unit.params for alias in p.aliases},
        state,
        run_id,
    )


def save(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    path: str | os.PathLike,
    *,
    step: int = 0,
    training_state: dict | None = None,
    keep_last: int | None = None,
) -> str:
    """Save a sharded checkpoint into run directory `path` as step-<step>; returns its path."""
    checkpointer = Checkpointer(module, optimizer)
    checkpointer.save(path, step=step, training_state=training_state, keep_last=keep_last)
    if checkpointer.last_saved is None:
        raise AssertionError(f"a synchronous save of step {step} into {path} returned without a checkpoint")
    return checkpointer.last_saved


def load(module: nn.Module, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike, *, strict: bool = True) -> dict:
    """Load a checkpoint (run directory or step directory) saved at any world size."""
    return Checkpointer(module, optimizer).load(path, strict=strict)


def init_weights_from(module: nn.Module, path: str | os.PathLike) -> None:
    """Load weights only, from a sharded checkpoint or a full (Hugging Face style) one."""
    _init_weights_from(module, checkpoint_path(path))


def checkpoint_path(path: str | os.PathLike) -> Path:
    """The path the readers of a load take: `path` itself, or the checkpoint at an object-store
    URL read in place (each rank's GETs stream the manifest and the bytes of the files it reads
    straight into memory; nothing is copied to disk)."""
    return stored_checkpoint(str(path)) if is_url(path) else source_path(path)


def _init_weights_from(module: nn.Module, path: str | os.PathLike) -> None:
    if not is_full_checkpoint(source_path(path)):
        Checkpointer(module, None).load(path, strict=False)
        return
    view = describe(module)
    expected = expected_tensors(view_params(view), module)
    with full_reader(path, list(expected)) as reader:
        check_full(reader, expected, path)
        load_weights(view, module, reader)


def check_before_launch(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    stored: tuple[str, Manifest] | None = None,
) -> None:
    """Validate a checkpoint against an unsharded model (built on the meta device) before any
    process starts: any problem is a DataCheckError (exit 3). `optimizer` (over the model's
    parameters) when resuming, None when only the weights are wanted. `stored`: (where, manifest)
    of a sharded checkpoint in an object store, whose rank files' headers were checked there."""
    params = [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]  # canonical: the first name
    names = {id(p): name for name, p in model.named_parameters()}
    if stored is not None:
        check_sharded(stored[1], stored[0], params, model, optimizer, names, strict=strict and optimizer is not None)
        return
    if is_full_checkpoint(source_path(path)) and optimizer is None:
        expected = expected_tensors(params, model)
        with full_reader(path, list(expected)) as reader:
            check_full(reader, expected, path)
        return
    with CheckpointReader(path) as checkpoint:
        check_sharded(
            checkpoint.manifest, str(checkpoint.step_dir), params, model, optimizer, names, strict=strict and optimizer is not None
        )


def check_sharded(
    manifest: Manifest,
    where: str,
    params: list[tuple[str, tuple[int, ...], bool]],
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    names: dict[int, str],
    *,
    strict: bool,
) -> tuple[dict[str, StateLayout] | None, list[str]]:
    """Check a sharded checkpoint's manifest (of the step at `where`) against a model (`names`: by
    id of the tensor the optimizer holds): (the optimizer's states to load, or None; the optimizer
    tensors it lacks)."""
    state = manifest.training_state
    stored = [tensor.name for tensor in manifest.tensors]
    states = None if optimizer is None else states_to_load(optimizer, names, state, stored, where=where)
    stateless = set((state.get("optimizer") or {}).get("stateless", []))  # the saved optimizer never stepped them
    expected = expected_tensors(params, module, states, stateless=stateless)
    return states, check_compatible(manifest, expected, strict=strict, where=where)


def check_full(reader: TensorReader, expected: dict[str, tuple[int, ...]], path: str | os.PathLike) -> None:
    for name, shape in expected.items():
        try:
            source = reader.source(name)
        except KeyError:
            raise DataCheckError(f"{path}: no tensor {name!r} (a checkpoint of another model?)") from None
        if tuple(source.shape) != tuple(shape):
            raise DataCheckError(f"{path}: tensor {name!r} has shape {list(source.shape)}, the model {list(shape)}")
