"""A sharded model and its optimizer <-> checkpoint fragments (the torch side).

The engine is read only through `fsdpkit.engine.view.describe`: its units, each parameter's
name, shape and this rank's fragment; collectives go through `fsdpkit.comm.Collectives`.
Saving: every rank builds the same manifest (format 2: nothing in it depends on the rank),
the ranks check with one all-reduce that they agree on it, each writes the file the layout
derives for it from its own data, no gather to rank 0; rank 0 commits. Loading: each local
fragment is read from the files that hold the overlapping fragments, and only from those,
so a checkpoint saved at W ranks loads at any W' and under any strategy.

Optimizer state tensors are `optim.<state>.<param name>`, laid out like their parameter; a
scalar state (Adam's step) lives with its parameter's first element (optim_state.py). Tied weights are stored
once with their alias recorded. With hybrid or no sharding, only the first replica writes.

Also here: starting from a full or sharded checkpoint's weights (`init_weights_from`; a full
checkpoint whose files record an export layout is read back in fsdpkit's names and orientation,
`RestoredReader`), and the check, on a model built on the meta device, that a checkpoint fits it
(`check_before_launch`). A save records the model's export recipe (`export.EXPORT_ATTR`, set by
its model source) in the training state, for `convert --to full`.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import faults
from ..comm import Collectives, new_group
from ..engine.view import ShardedModelView, describe
from ..errors import DataCheckError, RunError
from ..layout import ElementRange
from . import storage
from .background import WRITE_CHUNK_BYTES, HostBuffers, SaveTimings, lower_thread_priority
from .bytecopy import DEFAULT_CHUNK_SIZE, ByteCopier, SourceTensor
from .export import EXPORT_ATTR, EXPORT_STATE_KEY
from .format import rank_file_name
from .lock import process_identity, run_id_of
from .manifest import Manifest, check_compatible
from .optim_state import StateLayout, expected_state_tensors, load_optimizer_state, saved_states, states_to_load
from .placement import Placement, TensorSpec
from .reader import FullCheckpoint, is_full_checkpoint, open_checkpoint, open_full, open_sharded
from .writer import RankFileWriter

TORCH_TO_SAFETENSORS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
}
SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in TORCH_TO_SAFETENSORS.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    try:
        return TORCH_TO_SAFETENSORS[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be stored in a checkpoint") from None


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place (numpy's buffer protocol)."""
    array: Any = tensor.view(torch.uint8).numpy()  # numpy's stubs do not declare the buffer protocol
    return memoryview(array)


def tensor_bytes(data: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a tensor, copied to CPU if needed."""
    flat = data.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    return _byte_view(flat) if flat.numel() else memoryview(b"")


# ----- reading tensors by element ranges
class TensorReader:
    """Element ranges of named tensors as torch tensors, through the one `ByteCopier` (every
    checksummed piece verified the first time it is touched)."""

    def __init__(self, sources: list[SourceTensor], aliases: dict[str, str]):
        self._sources = {source.name: source for source in sources}
        self.aliases = dict(aliases)
        self._copier = ByteCopier(chunk_size=DEFAULT_CHUNK_SIZE)

    def source(self, name: str) -> SourceTensor:
        source = self._sources.get(self.aliases.get(name, name))
        if source is None:
            raise KeyError(f"no tensor {name!r} in the checkpoint")
        return source

    def tensor_names(self) -> list[str]:
        return list(self._sources)

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        """Elements `wanted` of the flat form of tensor `name` (an alias reads its stored tensor)."""
        source = self.source(name)
        if wanted.end > source.numel:
            raise ValueError(f"range [{wanted.start}, {wanted.end}) outside {source.name!r} of {source.numel} elements")
        out = torch.empty(wanted.size, dtype=SAFETENSORS_TO_TORCH[source.dtype])
        if wanted.size:
            self._copier.read_into(source, wanted, _byte_view(out))
        return out

    def read_tensor(self, name: str) -> torch.Tensor:
        source = self.source(name)
        return self.read_range(name, ElementRange(0, source.numel)).reshape(source.shape)

    def close(self) -> None:
        self._copier.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointReader(TensorReader):
    """A sharded checkpoint (run dir, following `latest`, or step dir) with a validated manifest.
    `validate_all=False` (loading in a worker) validates each file when first touched, so a
    rank reads only the files its chunk overlaps; otherwise every file is validated first."""

    def __init__(self, path: str | os.PathLike, *, validate_all: bool = True):
        self.checkpoint = open_sharded(path) if validate_all else open_checkpoint(path)
        super().__init__(self.checkpoint.sources(), self.checkpoint.manifest.aliases)

    @property
    def step_dir(self) -> Path:
        return self.checkpoint.step_dir

    @property
    def manifest(self) -> Manifest:
        return self.checkpoint.manifest

    @property
    def training_state(self) -> dict:
        return self.manifest.training_state

    def tensor(self, name: str) -> TensorSpec:
        """The tensor table's entry for `name` (an alias resolves to its stored tensor)."""
        return self.manifest.tensor(name)

    def fragments(self, name: str) -> list[tuple[str, ElementRange]]:
        """(file name, element range) of every fragment of tensor `name`, in order."""
        source = self.source(name)
        return [(piece.path.name, piece.range) for piece in source.pieces_in(ElementRange(0, source.numel))]


class RestoredReader(TensorReader):
    """A full checkpoint written with an export layout (`checkpoint/export.py`: the built-in GPT
    in GPT-2's names and Conv1D orientation), read under fsdpkit's names and orientation. An
    element range of a transposed weight is read as one short run from each stored row, so a
    rank still reads about the bytes it owns."""

    def __init__(self, full: FullCheckpoint):
        layout = full.layout
        if layout is None:
            raise ValueError(f"{full.root}: records no export layout to restore")
        sources, self._stored = [], {}
        for tensor in full.tensors:
            name = layout.original_name(tensor.name)
            if name is None:
                continue
            shape = tuple(reversed(tensor.shape))
            if layout.is_transposed(name, shape):
                self._stored[name] = tensor
                sources.append(SourceTensor(name, shape, tensor.dtype))
            else:
                sources.append(SourceTensor(name, tensor.shape, tensor.dtype, tensor.pieces))
        aliases = {layout.original_name(a) or a: layout.original_name(t) or t for a, t in full.aliases.items()}
        super().__init__(sources, aliases)

    def read_range(self, name: str, wanted: ElementRange) -> torch.Tensor:
        source = self.source(name)
        stored = self._stored.get(source.name)
        if stored is None:
            return super().read_range(name, wanted)
        rows, cols = source.shape  # fsdpkit's orientation; the file holds the (cols, rows) transpose
        out = torch.empty(wanted.size, dtype=SAFETENSORS_TO_TORCH[source.dtype])
        if not wanted.size:
            return out
        first, last = wanted.start // cols, (wanted.end - 1) // cols + 1
        block = torch.empty(cols, last - first, dtype=out.dtype)
        for column in range(cols):
            run = ElementRange(column * rows + first, column * rows + last)
            self._copier.read_into(stored, run, _byte_view(block[column]))
        return block.t().reshape(-1)[wanted.start - first * cols : wanted.end - first * cols].clone()


def full_reader(path: str | os.PathLike, names: Sequence[str] = ()) -> TensorReader:
    """A full (Hugging Face style) checkpoint's tensors, tied aliases resolved. When its files
    record an export layout and the `names` asked for are not there as stored, they are read
    through the layout (RestoredReader)."""
    full = open_full(path)
    stored = {t.name for t in full.tensors} | set(full.aliases)
    if full.layout is not None and not all(name in stored for name in names):
        return RestoredReader(full)
    return TensorReader(list(full.tensors), full.aliases)


# ----- what a model expects
def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return {name: tensor for name, tensor in module.state_dict().items() if name not in params and "." + name not in params}


def stateless_params(training_state: dict) -> set[str]:
    """Trainable parameters the saved optimizer held no state for (it never stepped them)."""
    return set((training_state.get("optimizer") or {}).get("stateless", []))


def expected_tensors(
    params: list[tuple[str, tuple[int, ...], bool]],
    buffers: dict[str, tuple[int, ...]],
    optimizer_states: dict[str, StateLayout] | None,
    *,
    stateless: AbstractSet[str] = frozenset(),
) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold for a model: (name, shape, requires_grad) of each
    parameter under its canonical name, the buffers, and the optimizer state of trainable
    parameters (`stateless`: those whose state the checkpoint rightly lacks)."""
    expected = {name: tuple(shape) for name, shape, _ in params}
    expected.update(buffers)
    expected.update(expected_state_tensors(params, optimizer_states or {}, stateless))
    return expected


def _view_params(view: ShardedModelView) -> list[tuple[str, tuple[int, ...], bool]]:
    return [(p.name, p.shape, p.requires_grad) for unit in view.units for p in unit.params]


def _model_params(model: nn.Module) -> list[tuple[str, tuple[int, ...], bool]]:
    """Canonical names (first in named_parameters order, as the engine's unit plan) of an unsharded model."""
    return [(name, tuple(p.shape), p.requires_grad) for name, p in model.named_parameters()]


def _buffer_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in persistent_buffers(module).items()}


# ----- saving
def tensor_table(
    view: ShardedModelView, module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[list[TensorSpec], dict[str, tuple[ElementRange, torch.Tensor]]]:
    """What a checkpoint of this model stores, in order: parameters (unit by unit), buffers,
    then each optimizer state (`optim.<state>.<param>`, as its parameter, or a scalar), and this
    rank's data of each: (element range held here, 1-D tensor: the live tensor, not a copy).
    The table is the same on every rank; the data is what this rank holds."""
    table: list[TensorSpec] = []
    local: dict[str, tuple[ElementRange, torch.Tensor]] = {}
    states: dict[str, list[TensorSpec]] = {}
    for unit in view.units:
        for param in unit.params:
            table.append(TensorSpec(param.name, safetensors_dtype(param.tensor.dtype), tuple(param.shape)))
            local[param.name] = (param.fragment.param_range, param.tensor.detach().reshape(-1))
            param_state = optimizer.state.get(param.tensor, {}) if optimizer is not None else {}
            for key, name, scalar_shape, held, data in saved_states(param.name, param.fragment.param_range, param.tensor, param_state):
                shape = tuple(param.shape) if scalar_shape is None else scalar_shape
                states.setdefault(key, []).append(TensorSpec(name, safetensors_dtype(data.dtype), shape))
                local[name] = (held, data)
    for name, tensor in persistent_buffers(module).items():
        table.append(TensorSpec(name, safetensors_dtype(tensor.dtype), tuple(tensor.shape)))
        local[name] = (ElementRange(0, tensor.numel()), tensor.detach().reshape(-1))
    for specs in states.values():
        table.extend(specs)
    return table, local


def optimizer_hyperparameters(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict | None:
    if optimizer is None:
        return None
    names = {id(p): name for name, p in module.named_parameters()}
    stateless = [names.get(id(p), "?") for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]
    groups = []
    for group in optimizer.param_groups:
        settings = {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in group.items()
            if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
        }
        groups.append({"settings": settings, "params": [names.get(id(p), "?") for p in group["params"]]})
    return {"type": type(optimizer).__name__, "groups": groups, "stateless": stateless}


def _digest(manifest: Manifest) -> int:
    """63 bits that every rank must agree on before writing: the tensor table and placement."""
    text = repr((manifest.world_size, manifest.placement, manifest.tensors, sorted(manifest.aliases.items())))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def write_rank(
    directory: Path,
    manifest: Manifest,
    rank: int,
    local: dict[str, tuple[ElementRange, torch.Tensor]],
    *,
    timings: SaveTimings | None = None,
) -> Path:
    """Write rank `rank`'s file of `manifest` from this rank's data (fsynced), in pieces of at
    most WRITE_CHUNK_BYTES (each one write and one crc32 update, both without the GIL); the
    time of each part is added to `timings`."""
    timings = timings if timings is not None else SaveTimings()
    layout = manifest.layout().file_layout(rank)
    path = directory / rank_file_name(rank, manifest.world_size)
    with RankFileWriter(path, layout) as writer:
        for fragment in layout.fragments:
            name = manifest.tensors[fragment.tensor].name
            held, data = local[name]
            if not (held.start <= fragment.start and fragment.end <= held.end):
                raise AssertionError(
                    f"{name}: rank {rank} holds [{held.start}, {held.end}), its file needs [{fragment.start}, {fragment.end})"
                )
            started = time.perf_counter()
            payload = tensor_bytes(data[fragment.start - held.start : fragment.end - held.start])
            timings.snapshot += time.perf_counter() - started
            crc = 0
            for offset in range(0, payload.nbytes, WRITE_CHUNK_BYTES):
                piece = payload[offset : offset + WRITE_CHUNK_BYTES]
                started = time.perf_counter()
                crc = zlib.crc32(piece, crc)
                timings.checksum += time.perf_counter() - started
                writer.write(piece)
            writer.end_fragment(crc)
    timings.write += writer.write_seconds
    timings.fsync += writer.fsync_seconds
    return path


@dataclass(frozen=True)
class SaveJob:
    """One save: what to write (`local`: this rank's data, None where it writes no file) and where."""

    view: ShardedModelView
    run_dir: Path
    step: int
    manifest: Manifest
    local: dict[str, tuple[ElementRange, torch.Tensor]] | None
    keep_last: int | None


class Checkpointer:
    """Saves and loads one sharded model with its optimizer. With async_save, save() copies
    this rank's tensors into `host_buffers` (allocated once, reused by every save while the
    table of tensors stays the same) and returns; a background thread at lower priority writes
    and checksums from there while training goes on (background.py). At most one save is in
    flight: the next save (or wait()) waits for it. Every rank must call save/load/wait.
    `timings` (SaveTimings) sums where this rank's save time went; `stall_seconds` how long
    the calling (training) thread spent inside save() and wait(): the snapshot, waiting for a
    previous save, and for a synchronous save all of it.

    `run_id` names the run that writes (default: this process; pass `RunLock.run_id` so that a
    restarted worker counts as the same run): `keep_last` prunes only this run's checkpoints.
    A save that fails on any rank (an OSError: disk full, read-only...) raises one RunError on
    every rank, leaves no temporary directory and keeps the previous checkpoint."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, async_save: bool = False, run_id: str | None = None
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        view = describe(module)
        self.async_save = async_save
        self.comm = Collectives()
        # background saves coordinate on their own group, so they never interleave with training's collectives
        self.group = new_group(backend="gloo") if async_save else view.group
        self.run_id = run_id or run_id_of(process_identity())  # only rank 0's is ever written
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_saved: str | None = None
        self.host_buffers = HostBuffers()
        self.timings = SaveTimings()
        self.stall_seconds = 0.0

    # ----- saving
    def save(self, run_dir: str | os.PathLike, *, step: int, training_state: dict | None = None, keep_last: int | None = None) -> None:
        started = time.perf_counter()
        try:
            self._join()
            self._start_save(Path(run_dir), step, training_state, keep_last)
        finally:
            self.stall_seconds += time.perf_counter() - started

    def _start_save(self, run_dir: Path, step: int, training_state: dict | None, keep_last: int | None) -> None:
        view = describe(self.module)
        table, local = tensor_table(view, self.module, self.optimizer)
        if self.async_save and view.writes_shards:
            started = time.perf_counter()
            snapshot = self.host_buffers.copy({name: data for name, (_, data) in local.items()})
            local = {name: (held, snapshot[name]) for name, (held, _) in local.items()}
            seconds = time.perf_counter() - started
            self.timings.snapshot += seconds
            self.timings.total += seconds
        state = dict(training_state or {})
        state["optimizer"] = optimizer_hyperparameters(self.module, self.optimizer)
        export = self.module.__dict__.get(EXPORT_ATTR)  # how convert hands it to transformers (export.py)
        if export is not None:
            state[EXPORT_STATE_KEY] = export.to_json()
        manifest = Manifest(
            view.shard_factor,
            view.strategy,
            Placement.flat([[(p.name, p.shape) for p in unit.params] for unit in view.units]),
            tuple(table),
            {alias: p.name for unit in view.units for p in unit.params for alias in p.aliases},
            state,
            self.run_id,
        )
        job = SaveJob(view, run_dir, step, manifest, local if view.writes_shards else None, keep_last)
        if self.async_save:
            self.thread = threading.Thread(target=self._run_save, args=(job,), name="fsdpkit-async-save", daemon=True)
            self.thread.start()
        else:
            self._save(job)

    def _run_save(self, job: SaveJob) -> None:
        lower_thread_priority()
        try:
            self._save(job)
        except BaseException as error:  # re-raised in the training thread by wait()
            self.error = error

    def _save(self, job: SaveJob) -> None:
        """The save protocol; any OSError (a full disk...) on any rank fails the save on every
        rank with one RunError, removes the temporary directory and keeps the previous checkpoint."""
        started = time.perf_counter()
        try:
            self._begin_write_and_commit(job)
        finally:
            self.timings.saves += 1
            self.timings.total += time.perf_counter() - started

    def _begin_write_and_commit(self, job: SaveJob) -> None:
        view, run_dir, step, manifest = job.view, job.run_dir, job.step, job.manifest
        begun: tuple[str | None, str | None] = (None, None)
        if view.rank == 0:
            try:
                begun = (str(storage.begin(run_dir, step, run_id=manifest.run_id)), None)
            except OSError as error:
                begun = (None, storage.os_error_line(error, run_dir))
        try:
            path, failure = self.comm.broadcast_object(begun, 0, self.group, label="checkpoint directory")
            if failure:
                raise RunError(f"checkpoint step {step} not saved: {failure}")
            self._write_and_commit(job, Path(path))
        except BaseException:  # a collective failed (a rank died or stopped...): nothing half-written stays
            if begun[0] is not None:
                storage.abort(begun[0])
            raise

    def _write_and_commit(self, job: SaveJob, tmp: Path) -> None:
        view, run_dir, step, manifest, local = job.view, job.run_dir, job.step, job.manifest, job.local
        device = torch.device("cpu") if self.async_save else view.device  # NCCL groups reduce device tensors
        digest = _digest(manifest)
        flags = torch.tensor([1 if tmp.is_dir() else 0, digest, -digest], dtype=torch.int64, device=device)
        self.comm.all_reduce(flags, self.group, op=dist.ReduceOp.MIN, label="checkpoint directory visible, same tensors")
        visible, low, high = (int(v) for v in flags.tolist())
        if not visible or low != -high:
            if view.rank == 0:
                storage.abort(tmp)
            if not visible:
                raise RunError(f"save directory {tmp} is not visible to every rank: --save-dir must be on a filesystem every node sees")
            raise RunError(
                f"ranks disagree on what to save at step {step} (tensor table or placement differ, "
                f"e.g. optimizer state for different parameters)"
            )
        failure = None
        if local is not None:
            try:
                write_rank(tmp, manifest, view.shard_rank, local, timings=self.timings)
                faults.reached("save", step)
            except OSError as error:
                failure = storage.os_error_line(error, tmp)
        written = torch.tensor([0 if failure else 1], dtype=torch.int64, device=device)
        self.comm.all_reduce(written, self.group, op=dist.ReduceOp.MIN, label="checkpoint files written")
        if not int(written.item()):
            if view.rank == 0:
                storage.abort(tmp)
            raise RunError(
                f"checkpoint step {step} not saved, previous checkpoint kept: " + (failure or "another rank could not write its file")
            )
        outcome: tuple[str | None, str | None] = (None, None)
        if view.rank == 0:
            try:
                outcome = (str(storage.commit(tmp, run_dir, step, manifest, keep_last=job.keep_last)), None)
            except OSError as error:
                outcome = (None, storage.os_error_line(error, tmp))
            except RunError as error:
                outcome = (None, str(error))
            if outcome[1]:
                storage.abort(tmp)
        path, failure = self.comm.broadcast_object(outcome, 0, self.group, label="checkpoint committed")
        if failure:
            raise RunError(f"checkpoint step {step} not saved, previous checkpoint kept: {failure}")
        self.last_saved = path

    def wait(self) -> None:
        """Wait for the save in flight, if any; raise its error."""
        started = time.perf_counter()
        try:
            self._join()
        finally:
            self.stall_seconds += time.perf_counter() - started

    def _join(self) -> None:
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
        view = describe(self.module)
        with CheckpointReader(path, validate_all=False) as reader:
            states = None
            if self.optimizer is not None:
                names = {id(p.tensor): p.name for unit in view.units for p in unit.params}
                states = states_to_load(self.optimizer, names, reader.training_state, reader.tensor_names(), where=str(reader.step_dir))
            stateless = stateless_params(reader.training_state)
            expected = expected_tensors(_view_params(view), _buffer_shapes(self.module), states, stateless=stateless)
            missing_optim = check_compatible(reader.manifest, expected, strict=strict, where=str(reader.step_dir))
            if missing_optim and view.rank == 0:
                warnings.warn(f"{reader.step_dir}: no optimizer state for {len(missing_optim)} tensors; starting it fresh", stacklevel=2)
            load_weights(view, self.module, reader)
            if self.optimizer is not None and states is not None and not missing_optim:
                params = [(p.name, p.fragment.param_range, p.tensor) for unit in view.units for p in unit.params if p.requires_grad]
                stored = set(reader.tensor_names())
                load_optimizer_state(self.optimizer, params, states, reader.training_state, stored, reader.read_range, reader.read_tensor)
            return reader.training_state


def load_weights(view: ShardedModelView, module: nn.Module, reader: TensorReader) -> None:
    """Copy this rank's fragment of every parameter, and every buffer, from `reader`."""
    with torch.no_grad():
        for unit in view.units:
            for param in unit.params:
                if param.fragment.param_range.size:
                    param.tensor.copy_(reader.read_range(param.name, param.fragment.param_range))
        for name, buffer in persistent_buffers(module).items():
            buffer.copy_(reader.read_tensor(name).to(buffer.dtype))


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


# ----- weights only, and checks before launch
def init_weights_from(module: nn.Module, path: str | os.PathLike) -> None:
    """Load weights only, from a sharded checkpoint or a full (Hugging Face style) one."""
    if not is_full_checkpoint(Path(path)):
        Checkpointer(module, None).load(path, strict=False)
        return
    view = describe(module)
    expected = expected_tensors(_view_params(view), _buffer_shapes(module), None)
    with full_reader(path, list(expected)) as reader:
        _check_full(reader, expected, path)
        load_weights(view, module, reader)


def _check_full(reader: TensorReader, expected: dict[str, tuple[int, ...]], path: str | os.PathLike) -> None:
    for name, shape in expected.items():
        try:
            source = reader.source(name)
        except KeyError:
            raise DataCheckError(f"{path}: no tensor {name!r} (a checkpoint of another model?)") from None
        if tuple(source.shape) != tuple(shape):
            raise DataCheckError(f"{path}: tensor {name!r} has shape {list(source.shape)}, the model {list(shape)}")


def check_before_launch(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, strict: bool) -> None:
    """Validate a checkpoint against an unsharded model (built on the meta device) before any
    process starts: any problem is a DataCheckError (exit 3). `optimizer` (over the model's
    parameters) when resuming, None when only the weights are wanted."""
    params, buffers = _model_params(model), _buffer_shapes(model)
    if is_full_checkpoint(Path(path)) and optimizer is None:
        expected = expected_tensors(params, buffers, None)
        with full_reader(path, list(expected)) as reader:
            _check_full(reader, expected, path)
        return
    with CheckpointReader(path) as reader:
        states = None
        if optimizer is not None:
            names = {id(p): name for name, p in model.named_parameters()}
            states = states_to_load(optimizer, names, reader.training_state, reader.tensor_names(), where=str(reader.step_dir))
        stateless = stateless_params(reader.training_state)
        check_compatible(
            reader.manifest,
            expected_tensors(params, buffers, states, stateless=stateless),
            strict=strict and optimizer is not None,
            where=str(reader.step_dir),
        )
