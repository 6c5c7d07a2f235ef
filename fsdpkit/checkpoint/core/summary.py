"""What `inspect` reports of a checkpoint: one dataclass per format's shape, each a `Summary`
with what that format adds; `to_json` is `--json`'s document, its keys the fields' names. The
other formats' summaries are defined in their packages."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .bytecopy import SourceTensor
from .names import is_optimizer_tensor, nbytes, numel

LARGEST = 5  # the largest tensors a summary lists


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int


@dataclass(frozen=True)
class TensorEntry:
    name: str | None  # None: a DCP key that maps to no fsdpkit name
    dtype: str
    shape: list[int]
    bytes: int

    @property
    def label(self) -> str:
        return str(self.name)


@dataclass(frozen=True)
class ModelCounts:
    tensors: int
    elements: int
    bytes: int


@dataclass(frozen=True)
class OptimizerCounts:
    tensors: int
    bytes: int


@dataclass(frozen=True)
class OptimizerStates(OptimizerCounts):
    """The optimizer of a DeepSpeed or torch.save checkpoint: its state names and param groups."""

    states: list[str]
    param_groups: list[Any]


@dataclass(frozen=True)
class Summary:
    path: str
    format: str  # the format's name
    model: ModelCounts
    optimizer: OptimizerCounts
    dtypes: dict[str, int]  # dtype -> tensors
    largest: list[TensorEntry]
    files: list[FileEntry]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class FullSummary(Summary):
    aliases: dict[str, str]  # tied name -> the name that holds its data


@dataclass(frozen=True)
class ShardedSummary(FullSummary):
    """fsdpkit's own checkpoint: the manifest's facts and what the training run recorded."""

    version: int
    world_size: int
    strategy: str
    placement: str
    units: int
    step: int | None
    samples: int | None
    data_position: dict[str, Any] | None  # where the training data loader stood (fsdpkit train)
    config: dict[str, Any] | None  # the training run's settings (fsdpkit train), if it recorded them
    fragments: int


def tensor_stats(items: list[tuple[str, str, tuple[int, ...]]]) -> tuple[ModelCounts, OptimizerCounts, dict[str, int], list[TensorEntry]]:
    """A summary's model, optimizer, dtypes and largest of (name, dtype, shape) items, optimizer states told by their names."""
    entries = [TensorEntry(name, dtype, list(shape), nbytes(shape, dtype)) for name, dtype, shape in items]
    model = [e for e in entries if not is_optimizer_tensor(str(e.name))]
    optim = [e for e in entries if is_optimizer_tensor(str(e.name))]
    return (
        ModelCounts(len(model), sum(numel(e.shape) for e in model), sum(e.bytes for e in model)),
        OptimizerCounts(len(optim), sum(e.bytes for e in optim)),
        dict(Counter(e.dtype for e in entries)),
        largest(entries),
    )


def tensor_entry(source: SourceTensor) -> TensorEntry:
    return TensorEntry(source.name, source.dtype, list(source.shape), source.nbytes)


def largest(entries: Sequence[TensorEntry]) -> list[TensorEntry]:
    return sorted(entries, key=lambda e: e.bytes, reverse=True)[:LARGEST]
