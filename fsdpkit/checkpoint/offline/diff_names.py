"""`diff` by the model's own names: a full export that `convert --to full --model` wrote in
transformers' names and orientation (its recorded `ExportLayout`), compared with a side in the
model's own layout, is read back into it: model tensors renamed, transposed weights read
transposed back (held whole while compared); the optimizer state keeps the model's names on
export. Names still in one side only are explained where a prefix added to one side's names
gives the other's.
"""

from __future__ import annotations

from collections import Counter

from ...flat_layout import ElementRange
from ..format.bytecopy import ByteEngine, SourceTensor
from ..format.export import ExportLayout
from ..format.names import is_optimizer_tensor
from .any_checkpoint import AnyCheckpoint

HINT_SAMPLE = 200  # names looked at to find a prefix


class TransposedSource(SourceTensor):
    """A 2-D weight stored transposed, in the model's orientation; `stored` is what the file holds."""

    stored: SourceTensor  # set through object.__setattr__: SourceTensor is frozen

    def __init__(self, name: str, stored: SourceTensor):
        super().__init__(name, tuple(reversed(stored.shape)), stored.dtype)
        object.__setattr__(self, "stored", stored)


class SideReader:
    """Element ranges of one side's tensors; a transposed weight is transposed back once, whole."""

    def __init__(self, engine: ByteEngine):
        self.engine = engine
        self._held: tuple[str, bytes] | None = None  # the last weight transposed back

    def read_into(self, tensor: SourceTensor, wanted: ElementRange, out: memoryview) -> None:
        if not isinstance(tensor, TransposedSource):
            self.engine.read_into(tensor, wanted, out)
            return
        if self._held is None or self._held[0] != tensor.name:
            from .convert import transposed_bytes

            self._held = (tensor.name, transposed_bytes(self.engine, tensor.stored, tensor.dtype).tobytes())
        itemsize = out.nbytes // max(wanted.size, 1)
        out[:] = self._held[1][wanted.start * itemsize : wanted.end * itemsize]

    def close(self) -> None:
        self.engine.close()


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
        if name != stored_name and layout.is_transposed(name, tuple(reversed(source.shape))):
            out[name] = TransposedSource(name, source)
            transposed += 1
        else:
            out[name] = source if name == stored_name else SourceTensor(name, source.shape, source.dtype, _all_pieces(source))
    how = f"prefix {layout.prefix!r} taken away" if layout.prefix else "names kept"
    return out, f"transformers' export read back as the model names it: {how}, {transposed} weights transposed back"


def _all_pieces(source: SourceTensor) -> tuple:
    return tuple(source.pieces_in(ElementRange(0, source.numel)))


def name_hints(only_a: list[str], only_b: list[str]) -> list[str]:
    """How the names in one side only relate, where a prefix explains most of them."""
    hints = []
    for (this, names), (that, others) in (("a", only_a), ("b", only_b)), (("b", only_b), ("a", only_a)):
        prefix = _common_prefix(names[:HINT_SAMPLE], set(others))
        if prefix is not None:
            matched = sum(1 for name in names if name[len(prefix) :] in set(others) and name.startswith(prefix))
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
