"""`fsdpkit diff A B`: two checkpoints of any format compared tensor by tensor (no torch), each
opened by `open_checkpoint` under fsdpkit's names (a full export read back into the model's
layout where the other side is in it: diff_names.py). Values are compared `chunk_size` bytes of
each side at a time, so memory does not grow with the tensor (a weight transposed back is held
whole): bitwise equal, else the largest absolute and relative difference, and whether every
element satisfies |a - b| <= atol + rtol * |b| (NaN equals NaN).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..format.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..format.names import is_optimizer_tensor
from .diff_names import SideReader, comparable, name_hints
from .formats import open_checkpoint

_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1"}
_NUMPY_DTYPES |= {"U16": "<u2", "U32": "<u4", "U64": "<u8", "BOOL": "u1"}


@dataclass(frozen=True)
class Tolerance:
    atol: float = 0.0
    rtol: float = 0.0

    def __post_init__(self) -> None:
        if not (self.atol >= 0 and self.rtol >= 0):
            raise UsageError(f"--atol and --rtol must be >= 0, got {self.atol} and {self.rtol}")


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


def compare_tensor(copiers: tuple[SideReader, SideReader], a: SourceTensor, b: SourceTensor, tolerance: Tolerance, block: int) -> dict:
    if a.dtype != b.dtype:
        return {"name": a.name, "status": "dtype", "a": a.dtype, "b": b.dtype}
    if tuple(a.shape) != tuple(b.shape):
        transposed = len(a.shape) == 2 and tuple(a.shape) == tuple(reversed(b.shape))
        return {"name": a.name, "status": "shape", "a": list(a.shape), "b": list(b.shape), "transposed": transposed}
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
    with open_checkpoint(path_a, model_key=dcp_keys[0], optimizer_key=dcp_keys[1]) as a:
        with open_checkpoint(path_b, model_key=dcp_keys[0], optimizer_key=dcp_keys[1]) as b:
            tensors_a, tensors_b, notes = comparable(a, b)
            names_a = [n for n in tensors_a if not (model_only and is_optimizer_tensor(n))]
            names_b = [n for n in tensors_b if not (model_only and is_optimizer_tensor(n))]
            common = [n for n in names_a if n in tensors_b]
            total = sum(tensors_a[n].nbytes for n in common)
            if progress is not None:
                progress(0, total)
            only_a = [n for n in names_a if n not in tensors_b]
            only_b = [n for n in names_b if n not in tensors_a]
            results = [{"name": n, "status": "only_a"} for n in only_a] + [{"name": n, "status": "only_b"} for n in only_b]
            readers = (SideReader(ByteEngine(chunk_size=chunk_size)), SideReader(ByteEngine(chunk_size=chunk_size)))
            try:
                for name in common:
                    results.append(compare_tensor(readers, tensors_a[name], tensors_b[name], tolerance, chunk_size))
                    if progress is not None:
                        progress(tensors_a[name].nbytes, total)
            finally:
                readers[0].close()
                readers[1].close()
    return {
        "a": {"path": a.path, "format": a.format, "tensors": len(names_a)},
        "b": {"path": b.path, "format": b.format, "tensors": len(names_b)},
        "atol": tolerance.atol,
        "rtol": tolerance.rtol,
        "model_only": model_only,
        "equal": all(r["status"] in ("equal", "close") for r in results),
        "counts": dict(Counter(r["status"] for r in results)),
        "names": notes,
        "hints": name_hints(only_a, only_b),
        "tensors": results,
    }
