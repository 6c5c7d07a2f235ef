"""GPT-2's Conv1D weights (in, out) in Megatron's Linear orientation (out, in): each one read
whole, transposed in memory (numpy, one weight at a time) and written to a scratch file, which the
byte engine then reads as any other source."""

from __future__ import annotations

from collections.abc import Container
from contextlib import closing
from pathlib import Path

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..core.bytecopy import ByteEngine, SourcePiece, SourceTensor

CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def is_conv1d_weight(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and name.endswith(CONV1D_WEIGHTS)


def transposed_sources(scratch: Path, tensors: dict[str, SourceTensor]) -> dict[str, SourceTensor]:
    """Each 2-D tensor of `tensors` transposed, by the same name, as `write_transposed` lays them in `scratch` (nothing read)."""
    found, offset = {}, 0
    for name, tensor in tensors.items():
        rows, cols = tensor.shape
        piece = SourcePiece(ElementRange(0, tensor.numel), scratch, offset, tensor.nbytes, None, name)
        found[name] = SourceTensor(name, (cols, rows), tensor.dtype, (piece,))
        offset += tensor.nbytes
    return found


def write_transposed(scratch: Path, tensors: dict[str, SourceTensor], chunk_size: int, only: Container[str] | None = None) -> None:
    """The file `scratch` (the caller removes it): each 2-D tensor transposed, one after another;
    with `only`, those tensors alone, each at its place (a sparse file: a spread rank's part)."""
    import numpy as np

    with closing(ByteEngine(chunk_size=chunk_size)) as engine, open(scratch, "wb") as out:
        offset = 0
        for name, tensor in tensors.items():
            if only is None or name in only:
                data = bytearray(tensor.nbytes)
                engine.read_into(tensor, ElementRange(0, tensor.numel), memoryview(data))
                unsigned = np.frombuffer(data, dtype=_UNSIGNED[dtype_info(tensor.dtype).itemsize]).reshape(tensor.shape)
                out.seek(offset)
                out.write(np.ascontiguousarray(unsigned.T).data)
            offset += tensor.nbytes
