"""Where every fragment of every saved tensor lives at a world size: pure range arithmetic,
derived from the manifest, never listed in it (format v2), by docs/checkpoint-format.md's
"Where each fragment lives" and "Rank files" (a "flat" placement lays each unit out with the
engine's own `FlatLayout`). A rank file's header is deterministic (`FileLayout`), so its size
is derived too; only the fragments' crc32s (in its `__metadata__`) come from the data.
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ...flat_layout import ElementRange, FlatLayout
from ..core.names import layout_header, split_optim_tensor_name
from .names import CRC_METADATA_KEY

Shape = tuple[int, ...]
MAX_CACHED_HEADER_BYTES = 32 << 20  # bounds the rank file headers a ShardLayout keeps


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of the manifest's table."""

    name: str
    dtype: str
    shape: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype).itemsize


@dataclass(frozen=True)
class Placement:
    kind: str  # "flat" or "even"
    units: tuple[tuple[tuple[str, Shape], ...], ...] = ()  # flat: each unit's (param name, shape) in flat order

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "even"):
            raise ValueError(f"placement kind must be 'flat' or 'even', got {self.kind!r}")
        if self.kind == "even" and self.units:
            raise ValueError("an even placement has no units")

    @classmethod
    def even(cls) -> Placement:
        return cls("even")

    @classmethod
    def flat(cls, units) -> Placement:
        """From a list of units, each a list of (param name, shape)."""
        return cls("flat", tuple(tuple((str(n), tuple(int(d) for d in s)) for n, s in unit) for unit in units))

    def param_shapes(self) -> dict[str, Shape]:
        return {name: shape for unit in self.units for name, shape in unit}

    def to_json(self) -> dict:
        if self.kind == "even":
            return {"kind": "even"}
        return {"kind": "flat", "units": [[name for name, _ in unit] for unit in self.units]}

    @classmethod
    def from_json(cls, document: object, *, shapes: dict[str, Shape], where: str) -> Placement:
        """Parse `{"kind": "even"}` or `{"kind": "flat", "units": [[name, ...], ...]}`; the
        shapes of the named parameters come from the tensor table (`shapes`)."""
        if not isinstance(document, dict) or document.get("kind") not in ("flat", "even") or len(document) > 2:
            raise DataCheckError(f"{where}: placement must be {{'kind': 'flat'|'even', ...}}, got {short(document)}")
        if document["kind"] == "even":
            if "units" in document:
                raise DataCheckError(f"{where}: an even placement has no units")
            return cls.even()
        units_doc = document.get("units")
        if not isinstance(units_doc, list):
            raise DataCheckError(f"{where}: a flat placement needs a list of units, got {short(units_doc)}")
        units, seen = [], set()
        for index, unit in enumerate(units_doc):
            if not isinstance(unit, list) or not all(isinstance(name, str) for name in unit):
                raise DataCheckError(f"{where}: placement unit {index} must be a list of parameter names, got {short(unit)}")
            for name in unit:
                if name in seen:
                    raise DataCheckError(f"{where}: parameter {name!r} appears twice in the placement")
                if name not in shapes:
                    raise DataCheckError(f"{where}: placement unit {index} names {name!r}, which the tensor table lacks")
                seen.add(name)
            units.append(tuple((name, shapes[name]) for name in unit))
        return cls("flat", tuple(units))


class FileFragment(NamedTuple):
    """Elements [start, end) of tensor `tensor` (an index into the tensor table) held by a rank."""

    tensor: int
    start: int
    end: int

    @property
    def range(self) -> ElementRange:
        return ElementRange(self.start, self.end)


@dataclass(frozen=True)
class FileLayout:
    """One rank file: its fragments in data order (as three parallel tuples), each one's byte
    span (relative to the data buffer), the header and where its crc32 hex digits sit in it,
    and the file size."""

    rank: int
    tensors: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]
    header: bytes  # length prefix included, crc digits all "0"
    crc_offset: int  # file offset of the first crc hex digit
    size: int

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def fragments(self) -> tuple[FileFragment, ...]:
        return tuple(map(FileFragment, self.tensors, self.starts, self.ends))

    def header_with(self, crcs) -> list[bytes]:
        """The header with the fragments' crc32s filled in, as three byte strings."""
        end = self.crc_offset + 8 * len(self.tensors)
        digits = struct.pack(f">{len(self.tensors)}I", *crcs).hex().encode("ascii")
        return [self.header[: self.crc_offset], digits, self.header[end:]]


class ShardLayout:
    """Every rank's fragments for one tensor table and placement at `world_size` (see the module
    docstring). Per-rank work is proportional to the fragments that rank holds."""

    def __init__(self, placement: Placement, tensors: list[TensorSpec], world_size: int):
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        self.placement, self.tensors, self.world_size = placement, list(tensors), world_size
        self._order_key = [(8 - dtype_info(t.dtype).itemsize) * len(self.tensors) + i for i, t in enumerate(self.tensors)]
        # flat: per unit, (chunk, numel, slot starts, slot ends, followers of each slot)
        self._units: list[tuple[int, int, list[int], list[int], list[list[int]]]] = []
        self._slot_of: dict[int, tuple[int, int]] = {}  # tensor -> (unit, slot) for tensors laid out like a parameter
        self._first_holder: dict[int, int] = {}  # scalar optimizer state -> rank holding its parameter's first element
        self._held_first: dict[int, list[int]] = {}  # rank -> the scalar optimizer states it holds
        self._whole: list[int] = []  # tensors stored whole on rank 0
        self._even: list[tuple[int, int, int]] = []  # (non-empty ranks, per-rank elements, tensor), most ranks first
        if placement.kind == "flat":
            self._init_flat()
        else:
            for i, t in enumerate(self.tensors):
                if t.numel:
                    per_rank = -(-t.numel // world_size)
                    self._even.append((-(-t.numel // per_rank), per_rank, i))
            self._even.sort(reverse=True)
        self._even_counts = [-count for count, _, _ in self._even]
        self._headers: dict[tuple, tuple] = {}  # fragment signature -> what file_layout shares between ranks
        self._cached_bytes = 0

    def _init_flat(self) -> None:
        param_slot: dict[str, tuple[int, int, int]] = {}  # name -> (unit, slot, numel)
        for u, unit in enumerate(self.placement.units):
            layout = FlatLayout.from_shapes(list(unit), self.world_size)
            slots = [slot for slot in layout.slots if slot.numel]
            param_slot.update((slot.name, (u, s, slot.numel)) for s, slot in enumerate(slots))
            starts = [slot.offset for slot in slots]
            ends = [slot.offset + slot.numel for slot in slots]
            self._units.append((layout.chunk_numel, layout.numel, starts, ends, [[] for _ in slots]))
        for i, t in enumerate(self.tensors):
            owner = t.name if t.name in param_slot else (split_optim_tensor_name(t.name) or (None, None))[1]
            if owner in param_slot and t.numel == param_slot[owner][2]:
                u, s, _ = param_slot[owner]
                self._units[u][4][s].append(i)
                self._slot_of[i] = (u, s)
            elif owner in param_slot and owner != t.name and t.numel == 1:
                u, s, _ = param_slot[owner]
                self._first_holder[i] = self._units[u][2][s] // self._units[u][0]
                self._held_first.setdefault(self._first_holder[i], []).append(i)
            elif t.numel:
                self._whole.append(i)

    def fragments(self, rank: int) -> list[FileFragment]:
        """Rank `rank`'s non-empty fragments, in data order."""
        return list(self.file_layout(rank).fragments)

    def _unordered(self, rank: int) -> tuple[list[int], list[int], list[int]]:
        """Rank `rank`'s fragments as (tensors, starts, ends), unit by unit (not in data order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world size {self.world_size}")
        tensors: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for chunk, numel, slot_starts, slot_ends, followers in self._units:
            lo = rank * chunk
            if lo >= numel:
                continue
            hi = min(lo + chunk, numel)
            s = max(bisect.bisect_right(slot_starts, lo) - 1, 0)
            while s < len(slot_starts) and slot_starts[s] < hi:
                begin = slot_starts[s]
                first, last = max(begin, lo) - begin, min(slot_ends[s], hi) - begin
                tensors.extend(followers[s])
                starts.extend([first] * len(followers[s]))
                ends.extend([last] * len(followers[s]))
                s += 1
        whole = self._held_first.get(rank, []) + (self._whole if rank == 0 else [])  # scalar states, then rank 0's whole tensors
        tensors.extend(whole)
        starts.extend([0] * len(whole))
        ends.extend(self.tensors[t].numel for t in whole)
        for _, per_rank, t in self._even[: bisect.bisect_left(self._even_counts, -rank)]:
            tensors.append(t)
            starts.append(rank * per_rank)
            ends.append(min((rank + 1) * per_rank, self.tensors[t].numel))
        return tensors, starts, ends

    def _spread(self, tensor: int) -> tuple[int, int]:
        """(begin, chunk): rank r holds elements [max(r * chunk - begin, 0), min((r + 1) * chunk -
        begin, numel)) of `tensor`, so element e lies on rank (begin + e) // chunk. A scalar
        state is (its rank, 1), a tensor stored whole on rank 0 (0, numel)."""
        numel = self.tensors[tensor].numel
        if tensor in self._slot_of:
            u, s = self._slot_of[tensor]
            return self._units[u][2][s], self._units[u][0]
        if tensor in self._first_holder:
            return self._first_holder[tensor], 1
        return 0, numel if self.placement.kind == "flat" else -(-numel // self.world_size)

    def piece_count(self, tensor: int) -> int:
        numel = self.tensors[tensor].numel
        begin, chunk = self._spread(tensor)
        return (begin + numel - 1) // chunk - begin // chunk + 1 if numel else 0

    def pieces(self, tensor: int, wanted: ElementRange | None = None) -> list[tuple[int, ElementRange]]:
        """(rank, range) of every fragment of `tensor` that meets `wanted` (default: all of them),
        in rank order; all of them tile the tensor's [0, numel) exactly once."""
        numel = self.tensors[tensor].numel
        wanted = wanted if wanted is not None else ElementRange(0, numel)
        if not wanted.size:
            return []
        begin, chunk = self._spread(tensor)
        first, last = (begin + wanted.start) // chunk, (begin + wanted.end - 1) // chunk
        return [(r, ElementRange(max(r * chunk - begin, 0), min((r + 1) * chunk - begin, numel))) for r in range(first, last + 1)]

    def whole_tensor_files(self) -> set[int]:
        """The ranks whose files hold tensors stored whole (scalar states with their
        parameter's first element, buffers on rank 0): a rank that loads its own part reads
        its own file and these."""
        return {rank for tensor in range(len(self.tensors)) if tensor not in self._slot_of for rank, _ in self.pieces(tensor)}

    def file_layout(self, rank: int) -> FileLayout:
        """Rank `rank`'s file. Its header depends only on which tensors the rank holds and how
        many elements of each, which many ranks share (at a large world size most chunks lie
        inside the same parameters), so it is built once per such signature."""
        tensors, starts, ends = self._unordered(rank)
        signature = (tuple(tensors), tuple(map(int.__sub__, ends, starts)))
        shared = self._headers.get(signature)
        if shared is None:
            shared = self._shared_layout(tensors, signature[1])
            if self._cached_bytes < MAX_CACHED_HEADER_BYTES:
                self._headers[signature] = shared
                self._cached_bytes += 4 * len(shared[3])  # the header, the signature and the spans
        order, ordered, spans, header, crc_offset, size = shared
        if order is not None:
            starts, ends = [starts[i] for i in order], [ends[i] for i in order]
        return FileLayout(rank, ordered, tuple(starts), tuple(ends), spans, header, crc_offset, size)

    def _shared_layout(self, tensors: list[int], sizes: tuple[int, ...]):
        """(order into data order or None, tensors in data order, spans, header, crc offset, size)."""
        order = sorted(range(len(tensors)), key=lambda i: self._order_key[tensors[i]])
        entries: list[tuple[str, str, Shape]] = [
            (self.tensors[tensors[i]].name, self.tensors[tensors[i]].dtype, (sizes[i],)) for i in order
        ]
        header, placed = layout_header(entries, {"format": "pt", CRC_METADATA_KEY: "0" * (8 * len(tensors))})
        return (
            None if order == list(range(len(order))) else tuple(order),
            tuple(tensors[i] for i in order),
            tuple((info.begin, info.end) for _, info in placed),
            header,
            8 + len('{"__metadata__":{"format":"pt","' + CRC_METADATA_KEY + '":"'),
            len(header) + sum(info.nbytes for _, info in placed),
        )


def short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
