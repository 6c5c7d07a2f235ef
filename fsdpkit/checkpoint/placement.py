"""Where each tensor's elements live at a given world size: pure range arithmetic.

A checkpoint's placement is either

- "flat": the model's flat-parameter plan, a list of units, each an ordered list of
  (param name, shape), laid out with `FlatLayout` at shard factor = world size; or
- "even": no plan, every tensor split with `even_split_ranges`.

`placements(plan, tensors, world_size)` gives, for every tensor, the non-empty ranges each
rank holds:

- a parameter of a flat plan: its intersection with each rank's chunk of its unit;
- `optim.<state>.<param>` with the same numel as a planned parameter: like that parameter;
- any other tensor under a flat plan (buffers, scalar optimizer state): whole, on rank 0;
- every tensor under an even plan: `even_split_ranges(numel, world_size)`.

Ranks hold ranges in increasing order (rank r's piece of a tensor precedes rank r+1's),
which lets convert/reshard stream every source fragment front to back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DataCheckError
from ..layout import ElementRange, FlatLayout, even_split_ranges
from .format import numel, split_optim_tensor_name

Shape = tuple[int, ...]
UnitSpec = tuple[tuple[str, Shape], ...]


@dataclass(frozen=True)
class Placement:
    kind: str  # "flat" or "even"
    units: tuple[UnitSpec, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("flat", "even"):
            raise ValueError(f"placement kind must be 'flat' or 'even', got {self.kind!r}")
        if self.kind == "even" and self.units:
            raise ValueError("an even placement has no units")

    @classmethod
    def even(cls) -> "Placement":
        return cls("even")

    @classmethod
    def flat(cls, units) -> "Placement":
        """From a list of units, each a list of (param name, shape)."""
        return cls("flat", tuple(tuple((str(n), tuple(int(d) for d in s)) for n, s in unit) for unit in units))

    def param_shapes(self) -> dict[str, Shape]:
        return {name: shape for unit in self.units for name, shape in unit}

    def to_json(self, world_size: int) -> dict:
        if self.kind == "even":
            return {"kind": "even"}
        return {"kind": "flat", "units": [
            {"params": [{"name": n, "shape": list(s)} for n, s in unit],
             "padding": FlatLayout.from_shapes(list(unit), world_size).padding}
            for unit in self.units]}

    @classmethod
    def from_json(cls, document: object, *, world_size: int, where: str) -> "Placement":
        if not isinstance(document, dict) or document.get("kind") not in ("flat", "even"):
            raise DataCheckError(f"{where}: plan must be {{'kind': 'flat'|'even', ...}}, got {_short(document)}")
        if document["kind"] == "even":
            return cls.even()
        units_doc = document.get("units")
        if not isinstance(units_doc, list):
            raise DataCheckError(f"{where}: flat plan needs a list of units, got {_short(units_doc)}")
        units, seen = [], set()
        for index, unit in enumerate(units_doc):
            params = unit.get("params") if isinstance(unit, dict) else None
            if not isinstance(params, list):
                raise DataCheckError(f"{where}: plan unit {index} has no list of params")
            spec = []
            for param in params:
                name = param.get("name") if isinstance(param, dict) else None
                shape = param.get("shape") if isinstance(param, dict) else None
                if not isinstance(name, str) or not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                    raise DataCheckError(f"{where}: plan unit {index} has an invalid param entry {_short(param)}")
                if name in seen:
                    raise DataCheckError(f"{where}: parameter {name!r} appears twice in the plan")
                seen.add(name)
                spec.append((name, tuple(shape)))
            padding = FlatLayout.from_shapes(spec, world_size).padding
            if unit.get("padding") != padding:
                raise DataCheckError(
                    f"{where}: plan unit {index} records padding {unit.get('padding')!r}, world size {world_size} gives {padding}")
            units.append(tuple(spec))
        return cls("flat", tuple(units))


def placements(placement: Placement, tensors: list[tuple[str, Shape]], world_size: int) -> dict[str, list[tuple[int, ElementRange]]]:
    """For each tensor, the (rank, range) pieces that tile [0, numel) in increasing order."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    param_pieces: dict[str, list[tuple[int, ElementRange]]] = {}
    for unit in placement.units:
        layout = FlatLayout.from_shapes(list(unit), world_size)
        chunk = layout.chunk_numel
        for slot in layout.slots:
            pieces = []
            if slot.numel:
                for rank in range(slot.offset // chunk, (slot.offset + slot.numel - 1) // chunk + 1):
                    piece = slot.flat_range.intersect(layout.chunk_range(rank))
                    pieces.append((rank, piece.shift(-slot.offset)))
            param_pieces[slot.name] = pieces
    shapes = placement.param_shapes()
    result = {}
    for name, shape in tensors:
        count = numel(shape)
        if name in param_pieces:
            result[name] = param_pieces[name]
            continue
        owner = split_optim_tensor_name(name)
        if owner and owner[1] in param_pieces and numel(shapes[owner[1]]) == count:
            result[name] = param_pieces[owner[1]]
        elif placement.kind == "flat":
            result[name] = [(0, ElementRange(0, count))] if count else []
        else:
            result[name] = [(r, rng) for r, rng in enumerate(even_split_ranges(count, world_size)) if rng.size]
    return result


def rank_contents(placement: Placement, tensors: list[tuple[str, Shape]], world_size: int) -> list[list[tuple[str, ElementRange]]]:
    """For each rank, the (tensor name, range) pieces its file holds, in tensor order."""
    per_rank: list[list[tuple[str, ElementRange]]] = [[] for _ in range(world_size)]
    for name, pieces in placements(placement, tensors, world_size).items():
        for rank, rng in pieces:
            per_rank[rank].append((name, rng))
    return per_rank


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
