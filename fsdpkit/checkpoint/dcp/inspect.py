"""`fsdpkit inspect` and `fsdpkit verify` of a DCP checkpoint (no torch). Bytes items are
listed with their sizes, never unpickled; DCP stores no checksums, so verify checks the
structure and says what it did not check.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ..core.files import source_path
from ..core.names import numel
from ..core.report import VerifyReport
from ..core.summary import FileEntry, ModelCounts, OptimizerCounts, Summary, TensorEntry, largest
from .layout import detect_layout
from .metadata import METADATA_GLOBALS, DcpTensor, read_metadata
from .table import DcpCheckpoint, open_dcp

FORMAT = "dcp"


def _nbytes(tensor: DcpTensor) -> int:
    return numel(tensor.shape) * dtype_info(tensor.dtype).itemsize


@dataclass(frozen=True)
class DcpTensorEntry(TensorEntry):
    key: str
    chunks: int

    @property
    def label(self) -> str:
        return self.key


@dataclass(frozen=True)
class BytesItem:
    key: str
    file: str
    bytes: int


@dataclass(frozen=True)
class DcpSummary(Summary):
    version: str | None
    serialization: list[str]
    model_key: str | None  # None: no model found
    optimizer_key: str | None
    other_tensors: list[str]  # keys of neither the model nor the optimizer
    chunks: int
    tensors: list[DcpTensorEntry]
    bytes_items: list[BytesItem]
    items: dict[str, int]  # the bytes items counted by group (`item_groups`)


def summarize_dcp(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> DcpSummary:
    with open_dcp(path) as checkpoint:
        return summarize_opened(checkpoint, model_key=model_key, optimizer_key=optimizer_key)


def summarize_opened(checkpoint: DcpCheckpoint, *, model_key: str | None, optimizer_key: str | None) -> DcpSummary:
    """The summary of an opened DCP checkpoint, local or in a storage."""
    metadata = checkpoint.metadata
    layout = detect_layout(metadata, model_key=model_key, optimizer_key=optimizer_key)
    for tensor in metadata.tensors.values():  # one chunk per file tells its serialization
        if tensor.chunks:
            checkpoint.chunk_data(tensor, tensor.chunks[0])
    names = {key: name for name, key in [*layout.model.items(), *layout.optimizer.items()]}
    tensors = [
        DcpTensorEntry(names.get(t.key), t.dtype, list(t.shape), _nbytes(t), t.key, len(t.chunks)) for t in metadata.tensors.values()
    ]
    model = [metadata.tensors[key] for key in layout.model.values()]
    optim = [metadata.tensors[key] for key in layout.optimizer.values()]
    return DcpSummary(
        path=str(metadata.directory),
        format=FORMAT,
        model=ModelCounts(len(model), sum(numel(t.shape) for t in model), sum(map(_nbytes, model))),
        optimizer=OptimizerCounts(len(optim), sum(map(_nbytes, optim))),
        dtypes=dict(Counter(t.dtype for t in metadata.tensors.values())),
        largest=largest(tensors),
        files=[FileEntry(name, checkpoint.file(name)[1]) for name in metadata.files],
        version=metadata.version,
        serialization=checkpoint.serializations,
        model_key=layout.model_key,
        optimizer_key=layout.optimizer_key,
        other_tensors=list(layout.other),
        chunks=sum(len(t.chunks) for t in metadata.tensors.values()),
        tensors=tensors,
        bytes_items=[BytesItem(b.key, b.location.file, b.location.length) for b in metadata.bytes_items.values()],
        items=item_groups(list(metadata.bytes_items), [*layout.model.values(), *layout.optimizer.values()]),
    )


def item_groups(item_keys: list[str], tensor_keys: list[str]) -> dict[str, int]:
    """The non-tensor items counted by their top-level key, or, under a key that also holds the
    model or optimizer tensors, by the shortest dotted prefix that holds none (so
    `optimizer.param_groups.0.lr` counts under `optimizer.param_groups`). Pure."""
    holding = {".".join(parts[:end]) for parts in (key.split(".") for key in tensor_keys) for end in range(1, len(parts))}
    groups: Counter[str] = Counter()
    for key in item_keys:
        parts = key.split(".")
        end = next((end for end in range(1, len(parts)) if ".".join(parts[:end]) not in holding), len(parts))
        groups[".".join(parts[:end])] += 1
    return dict(groups)


def verify_dcp(
    path: str | os.PathLike[str], allowed: Mapping[tuple[str, str], Any] = METADATA_GLOBALS, found: ChunkChecks | None = None
) -> VerifyReport:
    """`allowed`: the metadata's allow-list (a format built on DCP adds its own records); `found`:
    the chunks already checked (by the ranks of a spread verify), else they are checked here."""
    report = VerifyReport(str(path), FORMAT, not_checked=["tensor values (DCP stores no checksums)"])
    try:
        metadata = read_metadata(source_path(path), allowed)
    except DataCheckError as error:
        return report.failed(str(error))
    with DcpCheckpoint(metadata, root=source_path(path)) as checkpoint:
        return verify_opened(checkpoint, report, found)


@dataclass
class ChunkChecks:
    """Chunks located and checked: how many passed, the problems at their (tensor, chunk) places
    in the metadata's order, the serializations found."""

    checked: int = 0
    problems: list[tuple[int, int, str]] = field(default_factory=list)
    serializations: set[str] = field(default_factory=set)

    def add(self, other: ChunkChecks) -> None:
        self.checked += other.checked
        self.problems.extend(other.problems)
        self.serializations |= other.serializations


def chunk_checks(checkpoint: DcpCheckpoint, within: Callable[[str, int], bool] | None = None) -> ChunkChecks:
    """Every chunk of an opened file (those whose record's file and offset are `within`, or all)
    located and checked against the metadata."""
    found = ChunkChecks()
    for number, tensor in enumerate(checkpoint.metadata.tensors.values()):
        for index, chunk in enumerate(tensor.chunks):
            location = chunk.location
            if not checkpoint.opened(location.file) or (within is not None and not within(location.file, location.offset)):
                continue  # a file not opened is reported missing
            try:
                found.serializations.add(checkpoint.chunk_data(tensor, chunk).serialization)
                found.checked += 1
            except DataCheckError as error:
                found.problems.append((number, index, str(error)))
    return found


def verify_opened(checkpoint: DcpCheckpoint, report: VerifyReport, found: ChunkChecks | None = None) -> VerifyReport:
    """Every check of an opened DCP checkpoint, local or in a storage, into `report` (`found`: its
    chunks already checked)."""
    metadata = checkpoint.metadata
    problems = checkpoint.structure_problems()
    found = found if found is not None else chunk_checks(checkpoint)
    problems.extend(line for _, _, line in sorted(found.problems))
    report.ok, report.problems = not problems, problems
    report.tensors, report.bytes = len(metadata.tensors), sum(map(_nbytes, metadata.tensors.values()))
    report.counts = {"chunk": found.checked, "bytes item": len(metadata.bytes_items)}
    report.extra = {"serialization": sorted(found.serializations)}
    report.checked = [
        "metadata (allow-list unpickler)",
        "every file present, regular, holding its byte ranges",
        "every chunk's record parsed, its shape and dtype as declared",
        "each tensor's chunks cover it exactly once",
    ]
    return report
