"""`fsdpkit.open_checkpoint(path)`: a checkpoint of any format, read the way `safetensors.safe_open`
reads one file (offline/formats.py tells the format; the format's `open` builds it with the helpers here). Its names, slices and items:
docs/checkpoints.md, "Reading any checkpoint in Python". A DCP bytes item that names a class is
refused, never unpickled. torch is imported by `get_tensor` and `get_slice` only.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...dtypes import dtype_info
from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from .boxes import flat_runs
from .bytecopy import ByteEngine, SourceTensor
from .export import ExportLayout, HfExport
from .names import DATA_SOURCE_KEY, is_optimizer_tensor, split_optim_tensor_name

if TYPE_CHECKING:
    import torch

OPTIMIZER_NOT_CONVERTED = "optimizer_not_converted"  # a fact: why the source's optimizer state cannot be converted


@dataclass
class AnyCheckpoint:
    """A checkpoint of any format as named tensors and non-tensor items (see the module docstring)."""

    path: str
    model: dict[str, SourceTensor]  # tied aliases included
    optimizer: dict[str, SourceTensor]
    other: dict[str, SourceTensor] = field(default_factory=dict)  # DCP tensors neither model nor optimizer
    aliases: dict[str, str] = field(default_factory=dict)  # alias -> the stored name
    export_layout: ExportLayout | None = None  # a full export whose names/orientation differ from the model's
    items: dict[str, Callable[[], Any]] = field(default_factory=dict)  # non-tensor item -> its reader
    format: str = ""  # its name in formats.FORMATS, set by the one that opened it
    opened_from: str = ""  # the path it was opened by (a run directory, where `path` is its step), likewise
    opened_at: Path | None = None  # `opened_from` as the readers took it (a `StoredPath` in an object store), likewise
    groups: list[dict] = field(default_factory=list)  # the optimizer's param groups: [{"settings", "params"}]
    step: int = 0  # optimizer steps taken
    step_once: bool = False  # the step is recorded once (Megatron's param groups), not as a tensor per parameter
    export: HfExport | None = None  # the export recipe it records
    world_size: int = 1  # ranks it was saved by
    facts: dict[str, Any] = field(default_factory=dict)  # what a convert report says of the source
    full_dtype: str | None = None  # floats as `--to full` writes them unless --dtype (DeepSpeed's: fp32, as zero_to_fp32)
    # a full export's stored tensors and aliases under the model's own names and orientation, its
    # transposed tensors transposed back into the given scratch file (read in chunks of the given size)
    restore_layout: Callable[[Path, int], tuple[list[SourceTensor], dict[str, str]]] | None = None
    # a format whose names are not transformers': its model as transformers loads it (given `--model`, or None)
    transformers_view: Callable[[str | None], AnyCheckpoint] | None = None
    _close: Callable[[], None] = lambda: None
    _engine: ByteEngine | None = None

    @cached_property
    def sources(self) -> dict[str, SourceTensor]:
        """Every tensor by name: model, optimizer state, then the rest."""
        return {**self.model, **self.optimizer, **self.other}

    def stored(self) -> list[SourceTensor]:
        """Model tensors under their stored names only (no tied alias), then the optimizer state."""
        return [t for name, t in self.model.items() if name not in self.aliases] + list(self.optimizer.values())

    def keys(self) -> list[str]:
        return list(self.sources)

    def source(self, name: str) -> SourceTensor:
        found = self.sources.get(name)
        if found is None:
            raise UsageError(f"{self.path}: no tensor {name!r} (it holds {len(self.sources)}: {', '.join(list(self.sources)[:3])} ...)")
        return found

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.source(name).shape)

    def dtype(self, name: str) -> str:
        """The safetensors spelling (F32, BF16...)."""
        return self.source(name).dtype

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[()]

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self.source(name))

    def item_keys(self) -> list[str]:
        return list(self.items)

    def get_item(self, key: str) -> Any:
        reader = self.items.get(key)
        if reader is None:
            raise UsageError(f"{self.path}: no non-tensor item {key!r}")
        return reader()

    def read_into(self, source: SourceTensor, wanted: ElementRange, out: memoryview) -> None:
        if self._engine is None:
            self._engine = ByteEngine()
        self._engine.read_into(source, wanted, out)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        self._close()

    def __enter__(self) -> AnyCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorSlice:
    """`checkpoint.get_slice(name)`: `get_shape()`, `get_dtype()`, and `[index]` reading only the
    elements the index covers. An index is a tuple of ints and slices over the leading
    dimensions; a slice with a step reads the span from its start to its stop."""

    def __init__(self, checkpoint: AnyCheckpoint, source: SourceTensor):
        self._checkpoint, self._source = checkpoint, source

    def get_shape(self) -> list[int]:
        return list(self._source.shape)

    def get_dtype(self) -> str:
        return self._source.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        import torch

        shape = tuple(self._source.shape)
        offsets, sizes, picks = box_of(index, shape)
        itemsize = dtype_info(self._source.dtype).itemsize
        data = bytearray(max(1, math.prod(sizes)) * itemsize)
        view = memoryview(data)
        for first, count, within in flat_runs(shape, offsets, sizes) if shape else [(0, 1, 0)]:
            out = view[within * itemsize : (within + count) * itemsize]
            self._checkpoint.read_into(self._source, ElementRange(first, first + count), out)
        flat = torch.frombuffer(data, dtype=dtype_info(self._source.dtype).torch)[: math.prod(sizes)]
        box = flat.reshape(sizes)
        return box if all(pick == slice(None) for pick in picks) else box[picks].clone()


def box_of(index: Any, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]:
    """(offsets, sizes) of the box an index covers, and what picks the index's elements from
    that box (steps, and the dimensions an int drops). Pure arithmetic."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > len(shape):
        raise IndexError(f"{len(parts)} indices for a tensor of {len(shape)} dimensions {list(shape)}")
    box: list[tuple[int, int, Any]] = []  # (offset, size, pick) per dimension
    for dim, extent in enumerate(shape):
        part = parts[dim] if dim < len(parts) else slice(None)
        if isinstance(part, slice):
            start, stop, step = part.indices(extent)
            if step < 1:
                raise IndexError(f"dimension {dim}: a slice step must be positive, got {step}")
            box.append((start, max(0, stop - start), slice(None, None, step) if step > 1 else slice(None)))
        elif isinstance(part, int) and not isinstance(part, bool):
            at = part + extent if part < 0 else part
            if not 0 <= at < extent:
                raise IndexError(f"index {part} is out of range for dimension {dim} of size {extent}")
            box.append((at, 1, 0))
        else:
            raise IndexError(f"dimension {dim}: index with ints and slices, got {part!r}")
    offsets, sizes, picks = zip(*box, strict=True) if box else ((), (), ())  # a scalar's box has no dimension
    return offsets, sizes, picks


def steps_taken(optimizer: list[SourceTensor]) -> int:
    """Adam's step (an F32 scalar, the same for every parameter): the optimizer steps taken, 0 without one."""
    steps = [
        s for s in optimizer if (split := split_optim_tensor_name(s.name)) and split[0] == "step" and s.numel == 1 and s.dtype == "F32"
    ]
    if not steps:
        return 0
    with closing(ByteEngine()) as engine:
        return int(read_step(engine, steps[0]))


_STEP_FORMATS = {"F32": "<f", "F64": "<d", "I64": "<q", "I32": "<i"}


def read_step(engine: ByteEngine, source: SourceTensor) -> float:
    fmt = _STEP_FORMATS.get(source.dtype)
    if fmt is None or source.nbytes != struct.calcsize(fmt):
        raise DataCheckError(f"{source.name}: a step of {source.dtype} {list(source.shape)}, expected one number")
    data = bytearray(source.nbytes)
    engine.read_into(source, ElementRange(0, 1), memoryview(data))
    return float(struct.unpack(fmt, data)[0])


def with_aliases(tensors: dict[str, SourceTensor], aliases: dict[str, str]) -> dict[str, SourceTensor]:
    """Tied weights under every name (a DCP checkpoint stores each name)."""
    for alias, stored in aliases.items():
        if alias not in tensors and stored in tensors:
            tensors[alias] = tensors[stored]
    return tensors


def split_model_optimizer(tensors: list[SourceTensor], aliases: dict[str, str]) -> tuple[dict[str, SourceTensor], dict[str, SourceTensor]]:
    model = {t.name: t for t in tensors if not is_optimizer_tensor(t.name)}
    optimizer = {t.name: t for t in tensors if is_optimizer_tensor(t.name)}
    return with_aliases(model, aliases), optimizer


def recorded_data_source(opened: AnyCheckpoint) -> str | None:
    """The data source the run that wrote `opened` trained on, where it records one: an fsdpkit
    checkpoint's config, or the item fsdpkit's `convert --to dcp` writes from it."""
    if DATA_SOURCE_KEY in opened.items:
        value = opened.items[DATA_SOURCE_KEY]()
    else:
        config = opened.items["config"]() if "config" in opened.items else None
        data = config.get("data") if isinstance(config, dict) else None
        value = data.get("source") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def item_readers(values: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """Readers of items already read."""
    return {key: partial(values.__getitem__, key) for key in values}
