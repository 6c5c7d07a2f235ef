"""Export layouts applied to tensors (no torch): renamed names, and 2-D weights transposed one
tensor at a time with numpy.

A transposed tensor is read whole (cast on the way when asked) and transposed in memory, so
the memory bound of a conversion that transposes is the copier's chunk buffers plus two copies
of the largest transposed tensor (GPT-2 XL's mlp.c_fc: 1600 x 6400 fp32 = 41 MB, twice).
Every other tensor still streams in chunks.
"""

from __future__ import annotations

from pathlib import Path

from ..dtypes import dtype_info
from ..errors import DataCheckError
from ..layout import ElementRange
from .bytecopy import ByteEngine, SourceTensor
from .export import ExportLayout
from .format import is_optimizer_tensor
from .reader import FullCheckpoint, open_full
from .writer import StreamingWriter

_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def transposed_bytes(copier: ByteEngine, source: SourceTensor, out_dtype: str):
    """The 2-D tensor `source`, cast to `out_dtype`, transposed: a C-contiguous numpy array of
    its raw elements (unsigned integers of the element size, whatever the dtype)."""
    import numpy as np

    rows, cols = source.shape
    itemsize = dtype_info(out_dtype).itemsize
    data = bytearray(rows * cols * itemsize)
    filled = 0

    def collect(view: memoryview) -> None:
        nonlocal filled
        data[filled : filled + view.nbytes] = view
        filled += view.nbytes

    copier.copy(source, ElementRange(0, source.numel), out_dtype, collect)
    return np.ascontiguousarray(np.frombuffer(data, dtype=_UNSIGNED[itemsize]).reshape(rows, cols).T)


def restore_layout(
    full: FullCheckpoint, layout: ExportLayout, scratch: Path, *, chunk_size: int
) -> tuple[list[SourceTensor], dict[str, str]]:
    """The tensors of a full checkpoint written with `layout` (its `full.layout`), under
    fsdpkit's names and orientation, and its aliases likewise. Transposed tensors are transposed
    back into the safetensors file `scratch` (the caller removes it); the others are read where
    they are."""
    renamed, back = [], []
    for tensor in full.tensors:
        if is_optimizer_tensor(tensor.name):  # optimizer state keeps fsdpkit's names and orientation
            renamed.append(tensor)
            continue
        original = layout.original_name(tensor.name)
        if original is None:
            raise DataCheckError(
                f"{full.root}: tensor {tensor.name!r} does not follow the export layout the files record (prefix {layout.prefix!r})"
            )
        if layout.is_transposed(original, tuple(reversed(tensor.shape))):  # square ones too (attn.c_proj)
            back.append((original, tensor))
        else:
            renamed.append(SourceTensor(original, tensor.shape, tensor.dtype, tensor.pieces))
    if back:
        copier = ByteEngine(chunk_size=chunk_size)
        try:
            entries = [(name, tensor.dtype, tuple(reversed(tensor.shape))) for name, tensor in back]
            with StreamingWriter(scratch, entries, metadata={"format": "pt"}, sync=False) as writer:
                by_name = dict(back)
                for name, _ in writer.order:
                    writer.write(transposed_bytes(copier, by_name[name], by_name[name].dtype))
        finally:
            copier.close()
        restored = {t.name: t for t in open_full(scratch).tensors}
        renamed += [restored[name] for name, _ in back]
    aliases = {layout.original_name(alias) or alias: layout.original_name(target) or target for alias, target in full.aliases.items()}
    return renamed, aliases
