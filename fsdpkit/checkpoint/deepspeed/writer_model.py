"""DeepSpeed's model states files, written without torch or DeepSpeed (see `writer`).

Stages 1 and 2: one `mp_rank_00_model_states.pt` holding the module's state dict whole: the
trainable parameters, the frozen ones, the buffers, and each tied name as the same storage as
the name it is tied to. Stage 2 also lists the frozen parameters (`frozen_param_shapes`) with
their fragments (the same storages); stage 1 lists none, as DeepSpeed does.
Stage 3: one file per rank, parameters empty, buffers whole, each frozen parameter's fragment
the rank's part of it (`partition`). Every tensor in the run's dtype (`writer_precision`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..format.bytecopy import ByteEngine, SourceTensor
from ..format.crc import cast_into
from ..format.names import numel
from ..torchfile.pickler import Ordered, Raw, dumps
from ..torchfile.rawout import RawOutput
from . import writer_records as records
from .partition import Segment, param_partitions
from .writer_zip import Storage

if TYPE_CHECKING:
    from .writer import DsRun

CAST_ELEMENTS = 1 << 20  # elements read and cast at a time


class StoragePickle:
    """A data.pkl under construction: its storages, in the order they are named."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []

    def tensor(self, storage: Storage, shape: tuple[int, ...], dtype: str = "F32") -> Raw:
        self.storages.append(storage)
        return records.tensor(dtype, len(self.storages) - 1, shape)


def _cast(out: RawOutput, engine: ByteEngine, source: SourceTensor, wanted: ElementRange, dtype: str) -> None:
    for first in range(wanted.start, wanted.end, CAST_ELEMENTS):
        chunk = ElementRange(first, min(first + CAST_ELEMENTS, wanted.end))
        data = memoryview(bytearray(chunk.size * dtype_info(source.dtype).itemsize))
        engine.read_into(source, chunk, data)
        out.write(cast_into(data, source.dtype, dtype, bytearray(chunk.size * dtype_info(dtype).itemsize)))


def segment_storage(sources: dict[str, SourceTensor], segments: tuple[Segment, ...], dtype: str = "F32") -> Storage:
    """The segments' elements of `sources` as `dtype`, and the zeros of the padding segments."""
    itemsize = dtype_info(dtype).itemsize

    def fill(out: RawOutput, engine: ByteEngine) -> None:
        for segment in segments:
            if segment.name is None:
                out.write(bytes(itemsize * segment.elements.size))
            elif sources[segment.name].dtype == dtype:
                out.copy(sources[segment.name], segment.elements)
            else:
                _cast(out, engine, sources[segment.name], segment.elements, dtype)

    return Storage(itemsize * sum(s.elements.size for s in segments), fill)


def _whole(source: SourceTensor, dtype: str) -> Storage:
    return segment_storage({source.name: source}, (Segment(source.name, ElementRange(0, numel(source.shape))),), dtype)


def _fragment(pickle: StoragePickle, source: SourceTensor, rank: int, world_size: int, dtype: str) -> Raw:
    """Stage 3's part of a frozen parameter on `rank`."""
    part = param_partitions([(source.name, numel(source.shape))], world_size)[rank]
    return pickle.tensor(segment_storage({source.name: source}, part.segments, dtype), (part.numel,), dtype)


EMPTY = Storage(0, lambda out, engine: None)


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
    if rank is None and run.stage == 1:
        frozen_shapes, fragments = None, None
    else:
        frozen_shapes = Ordered([(s.name, records.size(tuple(s.shape))) for s in run.frozen])
        fragments = Ordered(
            [
                (s.name, records.tensor(dtypes[s.name], keys[s.name], tuple(s.shape)))
                if rank is None
                else (s.name, _fragment(pickle, s, rank, run.world_size, dtypes[s.name]))
                for s in run.frozen
            ]
        )
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
