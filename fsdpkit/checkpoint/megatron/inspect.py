"""`fsdpkit inspect` and `fsdpkit verify` of a Megatron checkpoint (no torch): the generation,
the parallel sizes and model shape it records, the optimizer state it holds; verify checks DCP's
structure, every chunk's record, and each file's SHA-256 where `integrity.json` lists it."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ..core.files import read_blocks, read_regular
from ..core.report import VerifyReport
from ..core.summary import FileEntry, OptimizerCounts, Summary, tensor_stats
from ..dcp.inspect import ChunkChecks, verify_dcp
from .files import FORMAT, INTEGRITY_NAME, TORCH_DIST, find_files
from .layers import OPTIMIZER_PREFIX
from .moments import Moments, moments_of
from .table import MEGATRON_METADATA_GLOBALS, MegatronCheckpoint, open_megatron

HASH_BLOCK = 1 << 20


@dataclass(frozen=True)
class MegatronSummary(Summary):
    generation: str
    nemo: bool
    parallel: dict[str, int]  # tensor, pipeline, data parallel sizes where recorded
    model_shape: dict[str, Any]
    optimizer_kind: str | None  # None: no optimizer state
    stored_keys: int
    bytes_items: int
    common_keys: list[str]


PARALLEL_ARGS = {"tensor": "tensor_model_parallel_size", "pipeline": "pipeline_model_parallel_size", "data": "data_parallel_size"}


def parallel_sizes(common: dict[str, Any]) -> dict[str, int]:
    recorded = common.get("args")
    args: dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    found = {name: args[key] for name, key in PARALLEL_ARGS.items() if isinstance(args.get(key), int)}
    world = args.get("world_size")
    if "data" not in found and isinstance(world, int) and found.get("tensor") and found.get("pipeline"):
        found["data"] = world // (found["tensor"] * found["pipeline"] * int(args.get("context_parallel_size") or 1))
    return found


def optimizer_kind(keys: list[str], common: dict[str, Any]) -> str | None:
    """What optimizer state the checkpoint holds, told by its keys."""
    optimizer = [key for key in keys if key.startswith(OPTIMIZER_PREFIX)]
    if not optimizer:
        return None
    if any(".distributed." in key or "dp_group_idx" in key for key in optimizer):
        return "distributed optimizer, dp_reshardable (flat buffers per data-parallel rank)"
    states = sorted({key.split(".")[2] for key in optimizer if key.startswith("optimizer.state.") and key.count(".") > 2})
    kind = "Adam" if {"exp_avg", "exp_avg_sq"} <= set(states) else "optimizer"
    return f"{kind}, by parameter ({', '.join(states)})"


def _with_moments(kind: str | None, moments: Moments) -> str | None:
    """The optimizer's kind, and whether its Adam moments convert (step taken), or why not."""
    if kind is None or moments.sharding is None:
        return kind
    if moments.refused is not None:
        return f"{kind}; moments not convertible: {moments.refused}"
    return f"{kind}; Adam's moments by parameter, step {moments.steps}"


def summarize_megatron(path: str | os.PathLike[str]) -> MegatronSummary:
    with open_megatron(path) as checkpoint:
        return _summary(checkpoint)


def _summary(checkpoint: MegatronCheckpoint) -> MegatronSummary:
    items = [(key, t.dtype, tuple(t.shape)) for key, t in checkpoint.stored.items()]
    model, _, dtypes, largest = tensor_stats([i for i in items if not i[0].startswith(OPTIMIZER_PREFIX)])
    optim, _, _, _ = tensor_stats([i for i in items if i[0].startswith(OPTIMIZER_PREFIX)])
    return MegatronSummary(
        path=str(checkpoint.files.root),
        format=FORMAT,
        model=model,
        optimizer=OptimizerCounts(optim.tensors, optim.bytes),
        dtypes=dict(Counter(t.dtype for t in checkpoint.stored.values())),
        largest=largest,
        files=[FileEntry(name, size) for name, size in checkpoint.data_files()],
        generation=checkpoint.generation,
        nemo=checkpoint.files.context is not None,
        parallel=parallel_sizes(checkpoint.common),
        model_shape=checkpoint.shape.to_json(),
        optimizer_kind=_with_moments(optimizer_kind(list(checkpoint.stored), checkpoint.common), moments_of(checkpoint)),
        stored_keys=len(checkpoint.stored),
        bytes_items=len(checkpoint.objects),
        common_keys=sorted(checkpoint.common),
    )


def integrity_hashes(weights: Path) -> dict[str, str]:
    """{file name: SHA-256 hex} of `integrity.json` ({} without one): a mapping of names to
    hashes, at its top or under `files`, or a list of {path|name|file, sha256}."""
    path = weights / INTEGRITY_NAME
    if not path.exists():
        return {}
    try:
        document = json.loads(read_regular(path, 1 << 26))
    except ValueError:
        raise DataCheckError(f"{path}: not JSON") from None
    files = document.get("files", document) if isinstance(document, dict) else document
    if isinstance(files, list):
        files = {str(e.get("path") or e.get("name") or e.get("file")): e.get("sha256") for e in files if isinstance(e, dict)}
    found = (
        {str(name): digest for name, digest in files.items() if isinstance(digest, str) and len(digest) == 64}
        if isinstance(files, dict)
        else {}
    )
    if not found:
        raise DataCheckError(f"{path}: lists no file with a SHA-256")
    return found


def _sha256(path: Path, buffer: memoryview) -> str:
    digest = hashlib.sha256()
    for block in read_blocks(path, buffer):
        digest.update(block)
    return digest.hexdigest()


def _zarr_report(weights: Path) -> VerifyReport:
    report = VerifyReport(str(weights), FORMAT, not_checked=["tensor values (zarr stores no checksums)"])
    report.ok = True
    report.checked = ["every array's .zarray", "every chunk file present, regular, of its chunk's size"]
    return report


@dataclass
class MegatronChecks:
    """What the ranks of a spread verify checked: the DCP chunks, and each hashed file's problem (or None)."""

    chunks: ChunkChecks | None
    hashed: dict[str, str | None]


def hash_problem(target: Path, digest: str, buffer: memoryview) -> str | None:
    """The line when file `target`'s SHA-256 is not `digest` (or it cannot be read); None when it is."""
    try:
        found = _sha256(target, buffer)
    except (DataCheckError, OSError) as error:
        return f"{target}: listed in {INTEGRITY_NAME} but not readable ({error})"
    return None if found == digest.lower() else f"{target}: SHA-256 {found}, {INTEGRITY_NAME} says {digest}"


def verify_megatron(path: str | os.PathLike[str], found: MegatronChecks | None = None) -> VerifyReport:
    """`found`: the chunks and hashed files already checked (by the ranks of a spread verify),
    else they are checked here."""
    files = find_files(path)
    if files is None:
        return VerifyReport(str(path), FORMAT).failed(f"{path}: not a Megatron checkpoint")
    chunks = found.chunks if found is not None else None
    report = verify_dcp(files.weights, MEGATRON_METADATA_GLOBALS, chunks) if files.backend == TORCH_DIST else _zarr_report(files.weights)
    report.path, report.kind = str(files.root), FORMAT
    try:
        hashes = integrity_hashes(files.weights)
        with open_megatron(path) as checkpoint:  # the common state through the allow-list, the model's shape
            if checkpoint.dcp is None:
                report.tensors, report.bytes = len(checkpoint.stored), sum(t.nbytes for t in checkpoint.stored.values())
    except DataCheckError as error:
        report.ok = False
        return report.failed(str(error))
    buffer = memoryview(bytearray(HASH_BLOCK))
    for name, digest in hashes.items():
        problem = found.hashed[name] if found is not None else hash_problem(files.weights / name, digest, buffer)
        if problem is not None:
            report.problems.append(problem)
    report.ok = not report.problems
    if hashes:
        report.counts["hashed file"] = len(hashes)
    report.checked = [*report.checked, "the common state (allow-list unpickler)"]
    if hashes:
        report.checked.append(f"the SHA-256 of the {len(hashes)} files {INTEGRITY_NAME} lists")
        report.not_checked = [n for n in report.not_checked if not n.startswith("tensor values")]
    else:
        report.not_checked.append(f"file hashes (no {INTEGRITY_NAME})")
    return report
