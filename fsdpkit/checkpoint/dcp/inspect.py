"""`fsdpkit inspect` and `fsdpkit verify` of a DCP checkpoint, as JSON-able dicts (no torch).

inspect: format, serialization, the model / optimizer keys found, every tensor (its key,
fsdpkit name, dtype, shape, chunks, bytes), the bytes items (listed with their sizes, never
unpickled, and counted by their top-level key: `item_groups`), files. verify: every file a regular file holding the byte ranges named, every
chunk's record parsed and checked against the declared shape and dtype, each tensor's chunks
covering it exactly once. DCP stores no checksums: the report says what was not checked.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Any

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ..format.names import numel
from ..format.report import VerifyReport
from .layout import detect_layout
from .metadata import DcpTensor, read_metadata
from .table import DcpCheckpoint, open_dcp

FORMAT = "dcp"
LARGEST = 5
NOT_CHECKED = "tensor values (DCP stores no checksums)"


def _nbytes(tensor: DcpTensor) -> int:
    return numel(tensor.shape) * dtype_info(tensor.dtype).itemsize


def summarize_dcp(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> dict:
    with open_dcp(path) as checkpoint:
        metadata = checkpoint.metadata
        layout = detect_layout(metadata, model_key=model_key, optimizer_key=optimizer_key)
        for tensor in metadata.tensors.values():  # one chunk per file tells its serialization
            if tensor.chunks:
                checkpoint.chunk_data(tensor, tensor.chunks[0])
        names = {key: name for name, key in layout.names.items()}
        tensors: list[dict[str, Any]] = [
            {
                "key": t.key,
                "name": names.get(t.key),
                "dtype": t.dtype,
                "shape": list(t.shape),
                "chunks": len(t.chunks),
                "bytes": _nbytes(t),
            }
            for t in metadata.tensors.values()
        ]
        model = [metadata.tensors[key] for key in layout.model.values()]
        optim = [metadata.tensors[key] for key in layout.optimizer.values()]
        summary: dict[str, Any] = {
            "path": str(metadata.directory),
            "format": FORMAT,
            "version": metadata.version,
            "serialization": checkpoint.serializations,
            "model_key": layout.model_key,
            "optimizer_key": layout.optimizer_key,
            "model": {"tensors": len(model), "bytes": sum(map(_nbytes, model)), "elements": sum(numel(t.shape) for t in model)},
            "optimizer": {"tensors": len(optim), "bytes": sum(map(_nbytes, optim))},
            "other_tensors": list(layout.other),
            "dtypes": dict(Counter(t.dtype for t in metadata.tensors.values())),
            "chunks": sum(len(t.chunks) for t in metadata.tensors.values()),
            "largest": sorted(tensors, key=lambda t: t["bytes"], reverse=True)[:LARGEST],
            "tensors": tensors,
            "bytes_items": [{"key": b.key, "file": b.location.file, "bytes": b.location.length} for b in metadata.bytes_items.values()],
            "items": item_groups(list(metadata.bytes_items), [*layout.model.values(), *layout.optimizer.values()]),
            "files": [{"name": name, "size": checkpoint.file(name)[1]} for name in metadata.files],
        }
    return summary


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


def verify_dcp(path: str | os.PathLike[str]) -> VerifyReport:
    report = VerifyReport(str(path), FORMAT, not_checked=[NOT_CHECKED])
    try:
        metadata = read_metadata(Path(path))
    except DataCheckError as error:
        return report.failed(str(error))
    with DcpCheckpoint(metadata) as checkpoint:
        problems = checkpoint.structure_problems()
        chunks = 0
        for tensor in metadata.tensors.values():
            for chunk in tensor.chunks:
                if not checkpoint.opened(chunk.location.file):
                    continue  # reported missing
                try:
                    checkpoint.chunk_data(tensor, chunk)
                    chunks += 1
                except DataCheckError as error:
                    problems.append(str(error))
        report.ok, report.problems = not problems, problems
        report.tensors, report.bytes = len(metadata.tensors), sum(map(_nbytes, metadata.tensors.values()))
        report.counts = {"chunk": chunks, "bytes item": len(metadata.bytes_items)}
        report.extra = {"serialization": checkpoint.serializations}
        report.checked = [
            "metadata (allow-list unpickler)",
            "every file present, regular, holding its byte ranges",
            "every chunk's record parsed, its shape and dtype as declared",
            "each tensor's chunks cover it exactly once",
        ]
    return report
