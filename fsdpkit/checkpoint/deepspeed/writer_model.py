"""DeepSpeed's model states files, written without torch or DeepSpeed (see `writer`).

Stages 1 and 2: one `mp_rank_00_model_states.pt` holding the module's state dict whole: the
trainable parameters, the frozen ones, the buffers, and each tied name as the same storage as
the name it is tied to. Stage 2 also lists the frozen parameters (`frozen_param_shapes`) with
their fragments (the same storages); stage 1 lists none, as DeepSpeed does.
Stage 3: one file per rank, parameters empty, buffers whole, each frozen parameter's fragment
the rank's part of it (`ceil(numel / N)` elements, the last ranks zero-padded).
Every tensor in the run's dtype (`writer_precision`): a bf16 or fp16 run's trainable parameters
are its fp32 masters rounded to nearest even, its floating frozen ones and buffers cast alike.
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


def elements(source: SourceTensor, wanted: ElementRange, padded_to: int, dtype: str) -> Storage:
    """Elements `wanted` of `source` as `dtype`, then zeros up to `padded_to` elements."""
    itemsize = dtype_info(dtype).itemsize

    def fill(out: RawOutput, engine: ByteEngine) -> None:
        if wanted.size and dtype == source.dtype:
            out.copy(source, wanted)
        elif wanted.size:
            _cast(out, engine, source, wanted, dtype)
        out.write(bytes(itemsize * (padded_to - wanted.size)))

    return Storage(itemsize * padded_to, fill)


def _whole(source: SourceTensor, dtype: str) -> Storage:
    return elements(source, ElementRange(0, numel(source.shape)), numel(source.shape), dtype)


def _fragment(source: SourceTensor, rank: int, world_size: int, dtype: str) -> Storage:
    total = numel(source.shape)
    size = -(-total // world_size)
    return elements(source, ElementRange(min(rank * size, total), min((rank + 1) * size, total)), size, dtype)


EMPTY = Storage(0, lambda out, engine: None)


def model_states(run: DsRun, rank: int | None, common: dict[str, Any]) -> tuple[bytes, list[Storage]]:
    """The model states file of stages 1 and 2 (`rank` None) or of stage 3's rank `rank`."""
    pickle, module, keys = StoragePickle(), [], {}
    params = [p.master for g in run.groups for p in g.params]
    dtypes = {s.name: run.precision.module_dtype(s.dtype) for s in (*params, *run.frozen, *run.buffers)}
    for source in (*params, *run.frozen, *run.buffers):
        if rank is None or source in run.buffers:
            module.append((source.name, pickle.tensor(_whole(source, dtypes[source.name]), tuple(source.shape), dtypes[source.name])))
            keys[source.name] = len(pickle.storages) - 1
        else:
            module.append((source.name, pickle.tensor(EMPTY, (0,), dtypes[source.name])))
    by_name = {s.name: s for s in (*params, *run.frozen, *run.buffers)}
    for alias, kept in run.aliases.items():
        if kept in keys:  # the storage of the name it is tied to
            module.append((alias, records.tensor(dtypes[kept], keys[kept], tuple(by_name[kept].shape))))
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
                else (
                    s.name,
                    pickle.tensor(
                        _fragment(s, rank, run.world_size, dtypes[s.name]), (-(-numel(s.shape) // run.world_size),), dtypes[s.name]
                    ),
                )
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
