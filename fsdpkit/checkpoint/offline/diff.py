"""`fsdpkit diff A B`: two checkpoints of any format compared tensor by tensor (no torch), each
opened by `open_checkpoint` under fsdpkit's names; what is compared and how: docs/dcp.md. A full
export read back into the model's layout has its transposed weights read transposed back and held
whole while compared; every other tensor is compared `chunk_size` bytes of each side at a time.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..core.any_checkpoint import AnyCheckpoint
from ..core.bytecopy import DEFAULT_CHUNK_SIZE, ByteEngine, SourceTensor
from ..core.export import ExportLayout
from ..core.names import is_optimizer_tensor
from ..core.request import progress_callback
from ..format.to_full import transposed_bytes
from .formats import open_checkpoint

HINT_SAMPLE = 200  # names looked at to find a prefix


class TransposedSource(SourceTensor):
    """A 2-D weight stored transposed, in the model's orientation; `stored` is what the file holds."""

    stored: SourceTensor  # set through object.__setattr__: SourceTensor is frozen

    def __init__(self, name: str, stored: SourceTensor):
        super().__init__(name, tuple(reversed(stored.shape)), stored.dtype)
        object.__setattr__(self, "stored", stored)


class SideReader(ByteEngine):
    """Element ranges of one side's tensors; a transposed weight is transposed back once, whole."""

    _held: tuple[str, bytes] | None = None  # the last weight transposed back

    def read_into(self, tensor: SourceTensor, wanted: ElementRange, out: memoryview) -> None:
        if not isinstance(tensor, TransposedSource):
            super().read_into(tensor, wanted, out)
            return
        if self._held is None or self._held[0] != tensor.name:
            self._held = (tensor.name, transposed_bytes(self, tensor.stored, tensor.dtype).tobytes())
        itemsize = out.nbytes // max(wanted.size, 1)
        out[:] = self._held[1][wanted.start * itemsize : wanted.end * itemsize]


def comparable(a: AnyCheckpoint, b: AnyCheckpoint) -> tuple[dict[str, SourceTensor], dict[str, SourceTensor], dict[str, str]]:
    """Both sides' model and optimizer tensors under names that compare, and, per side ("a",
    "b") whose export layout was read back, what was done."""
    tensors = [{**a.model, **a.optimizer}, {**b.model, **b.optimizer}]
    notes: dict[str, str] = {}
    layouts = [a.export_layout, b.export_layout]
    for side, (layout, other) in enumerate(zip(layouts, reversed(layouts), strict=True)):
        if layout is not None and not layout.is_identity and other is None:
            tensors[side], notes["ab"[side]] = _read_back(tensors[side], layout)
    return tensors[0], tensors[1], notes


def _read_back(tensors: dict[str, SourceTensor], layout: ExportLayout) -> tuple[dict[str, SourceTensor], str]:
    out: dict[str, SourceTensor] = {}
    transposed = 0
    for stored_name, source in tensors.items():
        name = stored_name if is_optimizer_tensor(stored_name) else layout.original_name(stored_name) or stored_name
        if name == stored_name:
            out[name] = source
        elif layout.is_transposed(name, tuple(reversed(source.shape))):
            out[name] = TransposedSource(name, source)
            transposed += 1
        else:
            out[name] = SourceTensor(name, source.shape, source.dtype, tuple(source.pieces_in(ElementRange(0, source.numel))))
    how = f"prefix {layout.prefix!r} taken away" if layout.prefix else "names kept"
    return out, f"transformers' export read back as the model names it: {how}, {transposed} weights transposed back"


def name_hints(only_a: list[str], only_b: list[str]) -> list[str]:
    """How the names in one side only relate, where a prefix explains most of them."""
    hints = []
    for (this, names), (that, others) in (("a", only_a), ("b", only_b)), (("b", only_b), ("a", only_a)):
        other_names = set(others)
        prefix = _common_prefix(names[:HINT_SAMPLE], other_names)
        if prefix is not None:
            matched = sum(1 for name in names if name[len(prefix) :] in other_names and name.startswith(prefix))
            hints.append(f"{matched} names in {this} only are {that}'s with the prefix {prefix!r} added")
    return hints


def _common_prefix(names: list[str], others: set[str]) -> str | None:
    """The prefix that, taken from the most of `names`, gives a name in `others` (at least half)."""
    counts: Counter[str] = Counter()
    for name in names:
        for cut in range(1, len(name)):
            if name[cut - 1] == "." and name[cut:] in others:
                counts[name[:cut]] += 1
    if not counts:
        return None
    prefix, count = counts.most_common(1)[0]
    return prefix if 2 * count >= len(names) else None


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
            advance = progress_callback(progress, sum(tensors_a[n].nbytes for n in common))
            only_a = [n for n in names_a if n not in tensors_b]
            only_b = [n for n in names_b if n not in tensors_a]
            results = [{"name": n, "status": "only_a"} for n in only_a] + [{"name": n, "status": "only_b"} for n in only_b]
            readers = (SideReader(chunk_size=chunk_size), SideReader(chunk_size=chunk_size))
            with closing(readers[0]), closing(readers[1]):
                for name in common:
                    results.append(compare_tensor(readers, tensors_a[name], tensors_b[name], tolerance, chunk_size))
                    if advance is not None:
                        advance(tensors_a[name].nbytes)
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
