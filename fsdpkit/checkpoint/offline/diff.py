"""`fsdpkit diff A B`: two checkpoints of any format compared tensor by tensor (no torch).

Each side is opened as a table of named tensors under fsdpkit's names (the model's names and
`optim.<state>.<param>`): an fsdpkit sharded checkpoint at any world size (tied aliases
included), full safetensors (with `optimizer*.safetensors` when present) or a DCP checkpoint
(`dcp.layout`). For every name: present in one only, a dtype or shape mismatch, or the values
compared block by block (`chunk_size` bytes of each side at a time, so memory does not grow
with the tensor): bitwise equal, else the largest absolute and relative difference, and
whether every element satisfies |a - b| <= atol + rtol * |b| (NaN equals NaN). Checksums of
sharded checkpoints are verified as their bytes are read.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..format.names import MANIFEST_NAME, OPTIM_INDEX, OPTIM_SINGLE, is_optimizer_tensor
from ..format.reader import is_full_checkpoint, open_full, open_sharded

_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
_NUMPY_DTYPES |= {"U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "u1"}


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0):
            raise UsageError(f"--atol and --rtol must be >= 0, got {self.atol} and {self.rtol}")


@dataclass(frozen=True)
class Side:
    path: str
    format: str
    tensors: dict[str, SourceTensor]


@contextlib.contextmanager
def open_tensors(path: str | os.PathLike[str], *, model_key: str | None = None, optimizer_key: str | None = None) -> Iterator[Side]:
    """Any checkpoint as {fsdpkit name: source}."""
    from ..dcp.metadata import is_dcp_checkpoint
    from ..deepspeed.files import is_deepspeed_checkpoint
    from ..torchsave.table import is_torchsave_checkpoint

    path = Path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    if is_dcp_checkpoint(path):
        from ..dcp.layout import detect_layout, layout_sources
        from ..dcp.table import open_dcp

        with open_dcp(path) as checkpoint:
            model, optim = layout_sources(checkpoint, detect_layout(checkpoint.metadata, model_key=model_key, optimizer_key=optimizer_key))
            yield Side(str(path), "dcp", {t.name: t for t in model + optim})
        return
    if is_deepspeed_checkpoint(path):
        from ..deepspeed.table import FORMAT, open_deepspeed

        with open_deepspeed(path) as deepspeed:
            yield Side(str(deepspeed.directory), FORMAT, _with_aliases({t.name: t for t in deepspeed.sources}, deepspeed.aliases))
        return
    if is_torchsave_checkpoint(path):
        from ..torchsave import table as torchsave

        with torchsave.open_rank_state_dicts(path) as ranks:
            yield Side(str(path), torchsave.FORMAT, {t.name: t for t in ranks.model})
        return
    if is_full_checkpoint(path) and not (path.is_dir() and (path / MANIFEST_NAME).exists()):
        root = path if path.is_dir() else path.parent
        with_optimizer = path.is_dir() and ((root / OPTIM_SINGLE).exists() or (root / OPTIM_INDEX).exists())
        full = open_full(path, with_optimizer=with_optimizer)
        yield Side(str(path), "safetensors-full", _with_aliases({t.name: t for t in full.tensors}, full.aliases))
        return
    sharded = open_sharded(path)
    yield Side(str(sharded.step_dir), "fsdpkit-checkpoint", _with_aliases({t.name: t for t in sharded.sources()}, sharded.manifest.aliases))


def _with_aliases(tensors: dict[str, SourceTensor], aliases: dict[str, str]) -> dict[str, SourceTensor]:
    """Tied weights under every name (a DCP checkpoint stores each name)."""
    for alias, stored in aliases.items():
        if alias not in tensors and stored in tensors:
            tensors[alias] = tensors[stored]
    return tensors


def _as_float64(np: Any, raw: bytearray | memoryview, dtype: str) -> Any:
    if dtype == "BF16":
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype]).astype(np.float64)


class _Comparison:
    """Running comparison of one tensor, block by block."""

    def __init__(self, tolerance: Tolerance):
        self.tolerance = tolerance
        self.bitwise, self.within = True, True
        self.max_abs, self.max_rel = 0.0, 0.0

    def add(self, np: Any, a: memoryview, b: memoryview, dtype: str) -> None:
        if np.array_equal(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)):
            return
        self.bitwise = False
        if dtype not in _NUMPY_DTYPES and dtype != "BF16":  # fp8: bytes only
            self.within, self.max_abs, self.max_rel = False, math.nan, math.nan
            return
        x, y = _as_float64(np, a, dtype), _as_float64(np, b, dtype)
        both_nan = np.isnan(x) & np.isnan(y)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            delta = np.where(both_nan, 0.0, np.abs(x - y))
            delta = np.where(np.isnan(delta), np.inf, delta)  # NaN against a number
            scale = np.abs(y)
            rel = np.where(delta == 0, 0.0, np.where(scale > 0, delta / scale, np.inf))
        self.max_abs = max(self.max_abs, float(delta.max()))
        self.max_rel = max(self.max_rel, float(rel.max()))
        if not bool(np.all(delta <= self.tolerance.atol + self.tolerance.rtol * scale)):
            self.within = False


def compare_tensor(copiers: tuple[ByteEngine, ByteEngine], a: SourceTensor, b: SourceTensor, tolerance: Tolerance, block: int) -> dict:
    if a.dtype != b.dtype:
        return {"name": a.name, "status": "dtype", "a": a.dtype, "b": b.dtype}
    if tuple(a.shape) != tuple(b.shape):
        return {"name": a.name, "status": "shape", "a": list(a.shape), "b": list(b.shape)}
    import numpy as np

    itemsize = dtype_info(a.dtype).itemsize
    step = max(1, block // itemsize)
    buffers = (bytearray(step * itemsize), bytearray(step * itemsize))
    comparison = _Comparison(tolerance)
    for first in range(0, a.numel, step):
        wanted = ElementRange(first, min(first + step, a.numel))
        views = [memoryview(buffer)[: wanted.size * itemsize] for buffer in buffers]
        copiers[0].read_into(a, wanted, views[0])
        copiers[1].read_into(b, wanted, views[1])
        comparison.add(np, views[0], views[1], a.dtype)
    if comparison.bitwise:
        return {"name": a.name, "status": "equal"}
    status = "close" if comparison.within else "different"
    return {"name": a.name, "status": status, "max_abs": comparison.max_abs, "max_rel": comparison.max_rel}


def diff(
    path_a: str | os.PathLike[str],
    path_b: str | os.PathLike[str],
    *,
    tolerance: Tolerance = Tolerance(),
    model_only: bool = False,
    dcp_keys: tuple[str | None, str | None] = (None, None),
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """The comparison as a JSON-able dict; `equal` is true when every tensor is present in both
    and equal within the tolerance."""
    with open_tensors(path_a, model_key=dcp_keys[0], optimizer_key=dcp_keys[1]) as a:
        with open_tensors(path_b, model_key=dcp_keys[0], optimizer_key=dcp_keys[1]) as b:
            names_a = [n for n in a.tensors if not (model_only and is_optimizer_tensor(n))]
            names_b = [n for n in b.tensors if not (model_only and is_optimizer_tensor(n))]
            common = [n for n in names_a if n in b.tensors]
            total = sum(a.tensors[n].nbytes for n in common)
            if progress is not None:
                progress(0, total)
            results = [{"name": n, "status": "only_a"} for n in names_a if n not in b.tensors]
            results += [{"name": n, "status": "only_b"} for n in names_b if n not in a.tensors]
            copiers = (ByteEngine(chunk_size=chunk_size), ByteEngine(chunk_size=chunk_size))
            try:
                for name in common:
                    results.append(compare_tensor(copiers, a.tensors[name], b.tensors[name], tolerance, chunk_size))
                    if progress is not None:
                        progress(a.tensors[name].nbytes, total)
            finally:
                copiers[0].close()
                copiers[1].close()
    counts: dict[str, int] = {}
    for result in results:
        counts[result["status"]] = counts.get(result["status"], 0) + 1
    return {
        "a": {"path": a.path, "format": a.format, "tensors": len(names_a)},
        "b": {"path": b.path, "format": b.format, "tensors": len(names_b)},
        "atol": tolerance.atol,
        "rtol": tolerance.rtol,
        "model_only": model_only,
        "equal": all(r["status"] in ("equal", "close") for r in results),
        "counts": counts,
        "tensors": results,
    }
