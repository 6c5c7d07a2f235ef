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
    "b") whose export layout was read back, what was done. A side whose names are not
    transformers' (Megatron) against one that has them is compared under transformers' names."""
    if (a.transformers_view is None) != (b.transformers_view is None):
        a, b = _as_transformers(a), _as_transformers(b)
    tensors = [{**a.model, **a.optimizer}, {**b.model, **b.optimizer}]
    notes: dict[str, str] = {}
    layouts = [a.export_layout, b.export_layout]
    for side, (layout, other) in enumerate(zip(layouts, reversed(layouts), strict=True)):
        if layout is not None and not layout.is_identity and other is None:
            tensors[side], notes["ab"[side]] = _read_back(tensors[side], layout)
    return tensors[0], tensors[1], notes


def _as_transformers(side: AnyCheckpoint) -> AnyCheckpoint:
    """A side under transformers' names, its weights in the orientation transformers' files hold them."""
    if side.transformers_view is None:
        return side
    view = side.transformers_view(None)
    layout = view.export.layout if view.export is not None else ExportLayout()
    view.model = {n: TransposedSource(n, t) if layout.is_transposed(n, t.shape) else t for n, t in view.model.items()}
    return view


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


@dataclass(frozen=True)
class DiffRequest:
    """What `diff A B` was asked, besides A."""

    b: str
    tolerance: Tolerance = Tolerance()
    model_only: bool = False
    dcp_keys: tuple[str | None, str | None] = (None, None)
    chunk_size: int = DEFAULT_CHUNK_SIZE


class Sides:
    """Two opened checkpoints' tensors under names that compare: those in both (`common`, in A's
    order, each compared by `compare_tensor`) and those in one only."""

    def __init__(self, a: AnyCheckpoint, b: AnyCheckpoint, request: DiffRequest):
        self.a, self.b, self.request = a, b, request
        self.tensors_a, self.tensors_b, self.notes = comparable(a, b)
        model_only = request.model_only
        self.names_a = [n for n in self.tensors_a if not (model_only and is_optimizer_tensor(n))]
        self.names_b = [n for n in self.tensors_b if not (model_only and is_optimizer_tensor(n))]
        self.common = [n for n in self.names_a if n in self.tensors_b]

    def readers(self) -> tuple[SideReader, SideReader]:
        return SideReader(chunk_size=self.request.chunk_size), SideReader(chunk_size=self.request.chunk_size)

    def compare(self, readers: tuple[SideReader, SideReader], name: str) -> dict:
        request = self.request
        return compare_tensor(readers, self.tensors_a[name], self.tensors_b[name], request.tolerance, request.chunk_size)

    def result(self, compared: list[dict]) -> dict:
        """The comparison as a JSON-able dict, from `compare`'s result for each of `common`, in order."""
        only_a = [n for n in self.names_a if n not in self.tensors_b]
        only_b = [n for n in self.names_b if n not in self.tensors_a]
        results = [{"name": n, "status": "only_a"} for n in only_a] + [{"name": n, "status": "only_b"} for n in only_b] + compared
        return {
            "a": {"path": self.a.path, "format": self.a.format, "tensors": len(self.names_a)},
            "b": {"path": self.b.path, "format": self.b.format, "tensors": len(self.names_b)},
            "atol": self.request.tolerance.atol,
            "rtol": self.request.tolerance.rtol,
            "model_only": self.request.model_only,
            "equal": all(r["status"] in ("equal", "close") for r in results),
            "counts": dict(Counter(r["status"] for r in results)),
            "names": self.notes,
            "hints": name_hints(only_a, only_b),
            "tensors": results,
        }


def diff(path_a: str | os.PathLike[str], request: DiffRequest, progress: Callable[[int, int], None] | None = None) -> dict:
    """The comparison as a JSON-able dict; `equal` is true when every tensor is present in both
    and equal within the tolerance."""
    model_key, optimizer_key = request.dcp_keys
    with open_checkpoint(path_a, model_key=model_key, optimizer_key=optimizer_key) as a:
        with open_checkpoint(request.b, model_key=model_key, optimizer_key=optimizer_key) as b:
            sides = Sides(a, b, request)
            advance = progress_callback(progress, sum(sides.tensors_a[n].nbytes for n in sides.common))
            compared = []
            readers = sides.readers()
            with closing(readers[0]), closing(readers[1]):
                for name in sides.common:
                    compared.append(sides.compare(readers, name))
                    if advance is not None:
                        advance(sides.tensors_a[name].nbytes)
            return sides.result(compared)
