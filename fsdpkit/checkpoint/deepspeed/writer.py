"""Writing a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, fp32 master weights with AdamW state,
of an fp32, bf16 or fp16 run: `writer_precision`) laid out for N data-parallel ranks
(`partition`), as DeepSpeed 0.19.8's `engine.save_checkpoint(dir, tag)` writes it, so its plain
`engine.load_checkpoint(dir)` at N ranks resumes it, optimizer included.

Stages 1 and 2's one model states file holds the module's state dict whole, each tied name as
the storage of the name it is tied to; stage 2 also lists the frozen parameters with their
fragments (the same storages), stage 1 none, as DeepSpeed does. Stage 3's model states file of
each rank: parameters empty, buffers whole, the rank's fragment of each frozen parameter.

No torch or DeepSpeed: every file is a torch zip (`torchfile.archive`; zip64 where a storage or
an offset reaches 4 GiB) whose data.pkl is pickled by name (`writer_records`), and every
partition's bytes are copied from the sources' byte ranges, cast where the output's dtype differs.
Each storage's CRC-32 is computed as its bytes go out and written after them, in the record's
data descriptor and the central directory, so a file is written front to back (a stream).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..core import workers
from ..core.bytecopy import ByteEngine, SourceTensor
from ..core.crc import PartRead, check_parts
from ..core.names import numel
from ..torchfile.archive import data_descriptor, torch_zip_parts
from ..torchfile.pickler import Ordered, Raw, dumps
from ..torchfile.rawout import ByteOutput, RawOutput
from . import writer_records as records
from .files import MODEL_FILE
from .partition import RankPartition, Segment, param_partitions, partitions
from .writer_precision import Precision

DS_VERSION = "0.19.8"
MOMENTS = ("exp_avg", "exp_avg_sq")
SPLIT_FILES = 4  # outputs of at least this many files are written by several processes
# torch.optim.AdamW's group settings, as DeepSpeed's checkpoint of it holds them
ADAMW_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 1e-2,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}


@dataclass(frozen=True)
class DsParam:
    name: str
    master: SourceTensor  # the fp32 weights
    moments: dict[str, SourceTensor]  # exp_avg, exp_avg_sq: fp32, shaped like the parameter


@dataclass(frozen=True)
class DsGroup:
    params: list[DsParam]
    step: float
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DsRun:
    groups: list[DsGroup]
    stage: int
    world_size: int
    global_steps: int
    frozen: tuple[SourceTensor, ...] = ()  # parameters without optimizer state, kept as they are
    buffers: tuple[SourceTensor, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name it is tied to
    global_samples: int = 0
    precision: Precision = Precision.F32  # the module's dtype in the run
    loss_scale: records.DynamicScale | None = None  # an fp16 run's scaler; None: as a fresh run starts it

    @property
    def tag(self) -> str:
        return f"global_step{self.global_steps}"


@dataclass(frozen=True)
class Storage:
    nbytes: int
    fill: Callable[[ByteOutput], None]  # appends exactly `nbytes`


class StoragePickle:
    """A data.pkl under construction: its storages, in the order they are named."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []

    def tensor(self, storage: Storage, shape: tuple[int, ...], dtype: str = "F32") -> Raw:
        self.storages.append(storage)
        return records.tensor(dtype, len(self.storages) - 1, shape)


def segment_storage(sources: dict[str, SourceTensor], segments: tuple[Segment, ...], dtype: str = "F32") -> Storage:
    """The segments' elements of `sources` as `dtype`, and the zeros of the padding segments."""
    itemsize = dtype_info(dtype).itemsize

    def fill(out: ByteOutput) -> None:
        for segment in segments:
            if segment.name is None:
                out.write(bytes(itemsize * segment.elements.size))
            elif sources[segment.name].dtype == dtype:
                out.copy(sources[segment.name], segment.elements)
            else:
                out.copy_via_engine(sources[segment.name], segment.elements, dtype)

    return Storage(itemsize * sum(s.elements.size for s in segments), fill)


def write_torch_zip(out: ByteOutput, prefix: str, data_pkl: bytes, storages: list[Storage]) -> None:
    """`data_pkl` and `storages` as a `torch.save` zip: the whole of `out`, written from its start."""
    sizes = [s.nbytes for s in storages]
    parts, crcs = torch_zip_parts(prefix, data_pkl, sizes, [0] * len(sizes)), list[int]()
    for key, storage in enumerate(storages):
        if key == 0:
            out.write(parts[0])
        else:  # the layout's descriptor (CRC-32 0) replaced by the one of the storage just written
            descriptor = data_descriptor(crcs[-1], sizes[key - 1])
            out.write(descriptor + parts[key][len(descriptor) :])
        start = out.position
        out.start_crc()
        storage.fill(out)
        crcs.append(out.crc())
        if out.position - start != storage.nbytes:
            raise AssertionError(f"{out.path}: storage {key} took {out.position - start} bytes, not {storage.nbytes}")
    out.write(torch_zip_parts(prefix, data_pkl, sizes, crcs)[-1])


def _check(run: DsRun) -> None:
    for group in run.groups:
        for param in group.params:
            for tensor in (param.master, *param.moments.values()):
                if tensor.dtype != "F32":
                    raise UsageError(f"{tensor.name}: DeepSpeed's master weights and Adam moments are float32, this is {tensor.dtype}")
            missing = [m for m in MOMENTS if m not in param.moments]
            if missing:
                raise UsageError(f"{param.name}: no {' or '.join(missing)} in the source (DeepSpeed output needs AdamW state)")


def _settings(group: DsGroup, index: int) -> dict[str, Any]:
    given = {key: tuple(value) if isinstance(value, list) else value for key, value in group.settings.items() if key in ADAMW_DEFAULTS}
    return ADAMW_DEFAULTS | given | {"params": [index]}


def _step(value: float) -> Storage:
    return Storage(4, lambda out: out.write(struct.pack("<f", value)))


def _adam_state(pickle: StoragePickle, run: DsRun, rank_parts: list[RankPartition]) -> dict:
    """The base optimizer's state_dict over the rank's flat partitions, one per group."""
    state, groups = {}, []
    for index, (group, part) in enumerate(zip(run.groups, rank_parts, strict=True)):
        state[index] = {"step": pickle.tensor(_step(group.step), ())}
        for m in MOMENTS:
            state[index][m] = pickle.tensor(segment_storage({p.name: p.moments[m] for p in group.params}, part.segments), (part.numel,))
        groups.append(_settings(group, index))
    return {"state": state, "param_groups": groups}


def _common(run: DsRun) -> dict[str, Any]:
    return {"ds_config": {"zero_optimization": {"stage": run.stage}, **run.precision.config}, "ds_version": DS_VERSION}


def _optim_states(run: DsRun, rank_parts: list[RankPartition]) -> tuple[bytes, list[Storage]]:
    """A rank's optimizer states file: the Adam state, then the rank's fp32 partition of each group."""
    pickle = StoragePickle()
    base = _adam_state(pickle, run, rank_parts)
    fp32 = []
    for group, part in zip(run.groups, rank_parts, strict=True):
        unpadded = part.segments[:-1] if part.padding else part.segments  # stages 1/2: the group's padding is left out
        fp32.append(pickle.tensor(segment_storage({p.name: p.master for p in group.params}, unpadded), (part.numel - part.padding,)))
    if run.stage == 3:
        state = {
            "zero_stage": records.zero_stage(3),
            **run.precision.scaler_state(run.loss_scale),
            "overflow": False,
            "partition_count": run.world_size,
            "optimizer_state_dict": base,
            "fp32_flat_groups": fp32,
        }
        return dumps({"optimizer_state_dict": state, **_common(run)}), pickle.storages
    state = {
        **run.precision.scaler_state(run.loss_scale),
        "overflow": False,
        "base_optimizer_state": base,
        "single_partition_of_fp32_groups": fp32,
        "zero_stage": records.zero_stage(run.stage),
        "group_paddings": [part.padding for part in rank_parts],
        "param_alignment_paddings": [[0] * len(group.params) for group in run.groups],
        "partition_count": [run.world_size] * len(run.groups),
        "ds_version": DS_VERSION,
        "param_slice_mappings": [
            Ordered([(name, records.fragment_address(count, start)) for name, start, count in part.slice_mappings()]) for part in rank_parts
        ],
    }
    return dumps({"optimizer_state_dict": state, **_common(run)}), pickle.storages


def _whole(source: SourceTensor, dtype: str) -> Storage:
    return segment_storage({source.name: source}, (Segment(source.name, ElementRange(0, numel(source.shape))),), dtype)


def _fragment(pickle: StoragePickle, source: SourceTensor, rank: int, world_size: int, dtype: str) -> Raw:
    """Stage 3's part of a frozen parameter on `rank`."""
    part = param_partitions([(source.name, numel(source.shape))], world_size)[rank]
    return pickle.tensor(segment_storage({source.name: source}, part.segments, dtype), (part.numel,), dtype)


EMPTY = Storage(0, lambda out: None)


def model_states(run: DsRun, rank: int | None, common: dict[str, Any]) -> tuple[bytes, list[Storage]]:
    """The model states file of stages 1 and 2 (`rank` None) or of stage 3's rank `rank`."""
    pickle, module, keys = StoragePickle(), [], {}
    tensors = {s.name: s for s in (*(p.master for g in run.groups for p in g.params), *run.frozen, *run.buffers)}
    dtypes = {name: run.precision.module_dtype(s.dtype) for name, s in tensors.items()}
    for name, source in tensors.items():
        if rank is None or source in run.buffers:
            module.append((name, pickle.tensor(_whole(source, dtypes[name]), tuple(source.shape), dtypes[name])))
            keys[name] = len(pickle.storages) - 1
        else:
            module.append((name, pickle.tensor(EMPTY, (0,), dtypes[name])))
    for alias, kept in run.aliases.items():
        if kept in keys:  # the storage of the name it is tied to
            module.append((alias, records.tensor(dtypes[kept], keys[kept], tuple(tensors[kept].shape))))
        else:
            module.append((alias, pickle.tensor(EMPTY, (0,), dtypes[kept])))
    frozen_shapes, fragments = None, None  # stage 1 lists no frozen parameters
    if rank is not None:
        fragments = Ordered([(s.name, _fragment(pickle, s, rank, run.world_size, dtypes[s.name])) for s in run.frozen])
    elif run.stage != 1:
        fragments = Ordered([(s.name, records.tensor(dtypes[s.name], keys[s.name], tuple(s.shape))) for s in run.frozen])
    if fragments is not None:
        frozen_shapes = Ordered([(s.name, records.size(tuple(s.shape))) for s in run.frozen])
    state = {
        "module": Ordered(module),
        "buffer_names": [s.name for s in run.buffers],
        "optimizer": None,
        "param_shapes": [Ordered([(p.name, records.size(tuple(p.master.shape))) for p in group.params]) for group in run.groups],
        "frozen_param_shapes": frozen_shapes,
        "shared_params": dict(run.aliases),
        "frozen_param_fragments": fragments,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": run.global_steps,
        "global_samples": run.global_samples,
        "dp_world_size": run.world_size,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        **common,
    }
    return dumps(state), pickle.storages


@dataclass(frozen=True)
class DsFile:
    """One file of the tag directory: `name`, its data.pkl and its storages, `nbytes` in all."""

    name: str
    data_pkl: bytes
    storages: list[Storage]

    def parts(self, crcs: list[int] | None = None) -> list[tuple[int, bytes]]:
        """(offset, bytes) of each part of the file around its storages' data, with the storages'
        CRC-32s `crcs` (None: zeros, for the layout)."""
        sizes = [s.nbytes for s in self.storages]
        parts = torch_zip_parts(self.name.removesuffix(".pt"), self.data_pkl, sizes, crcs or [0] * len(sizes))
        placed, position = [], 0
        for part, size in zip(parts, [*sizes, 0], strict=True):
            placed.append((position, part))
            position += len(part) + size
        return placed

    @property
    def nbytes(self) -> int:
        offset, last = self.parts()[-1]
        return offset + len(last)

    def write(self, out: ByteOutput) -> None:
        write_torch_zip(out, self.name.removesuffix(".pt"), self.data_pkl, self.storages)

    def data_spans(self) -> list[tuple[int, int]]:
        """[begin, end) of each storage's data in the file."""
        return [(offset + len(part), offset + len(part) + s.nbytes) for (offset, part), s in zip(self.parts(), self.storages, strict=False)]

    def storage_spans(self, step: int) -> tuple[tuple[int, int, int], ...]:
        """(first, last, step) of each storage's data in the file: where a part of it may start."""
        return tuple((begin, end, step) for begin, end in self.data_spans() if end > begin)


def deepspeed_files(run: DsRun) -> list[DsFile]:
    """The files of `run`'s tag directory, before any is written (`latest` names the tag)."""
    _check(run)
    layouts = [partitions(run.stage, [(p.name, numel(p.master.shape)) for p in g.params], run.world_size) for g in run.groups]
    files: list[DsFile] = []
    if run.stage != 3:
        files.append(DsFile(MODEL_FILE, *model_states(run, None, _common(run))))
    for rank, rank_parts in enumerate(zip(*layouts, strict=True)):
        if run.stage == 3:
            files.append(DsFile(f"zero_pp_rank_{rank}_{MODEL_FILE}", *model_states(run, rank, _common(run))))
        files.append(
            DsFile(f"{run.precision.optim_prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", *_optim_states(run, list(rank_parts)))
        )
    return files


def write_deepspeed(directory: Path, run: DsRun, progress: Callable[[int], None] | None = None) -> list[str]:
    """`latest` and the tag directory's files in `directory` (not synced: the caller's staged
    output syncs); returns the files' paths relative to `directory`. The files are shared out
    by size between `workers.process_count` processes."""
    files = deepspeed_files(run)
    tag = directory / run.tag
    tag.mkdir()

    def write(share: range, report: Callable[[int], None] | None) -> list[PartRead]:
        engine = ByteEngine()
        try:
            for file in files[share.start : share.stop]:
                with RawOutput(tag / file.name, engine, report) as out:
                    file.write(out)
            return engine.finish_parts()
        finally:
            engine.close()

    sizes = [sum(s.nbytes for s in file.storages) for file in files]
    shares = workers.even_shares(sizes, workers.process_count(len(files), split_at=SPLIT_FILES))
    check_parts([part for parts in workers.in_processes(shares, write, progress) for part in parts])
    (directory / "latest").write_text(run.tag)
    return ["latest", *(f"{run.tag}/{file.name}" for file in files)]
