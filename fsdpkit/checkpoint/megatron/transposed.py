"""GPT-2's Conv1D weights (in, out) in Megatron's Linear orientation (out, in): each one read by
blocks of its rows, each block transposed in memory (numpy) and written to its place in a scratch
file, which the byte engine then reads as any other source."""

from __future__ import annotations

from collections.abc import Container
from contextlib import closing
from pathlib import Path
from typing import BinaryIO

from ...dtypes import dtype_info
from ...flat_layout import ElementRange
from ..core.bytecopy import ByteEngine, SourcePiece, SourceTensor

CONV1D_WEIGHTS = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
_UNSIGNED = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}
TRANSPOSE_BLOCK_BYTES = 16 << 20  # of a weight's rows read at once: what its transposition holds, twice


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
    with closing(ByteEngine(chunk_size=chunk_size)) as engine, open(scratch, "wb") as out:
        offset = 0
        for name, tensor in tensors.items():
            if only is None or name in only:
                _write_one(engine, tensor, out, offset)
            offset += tensor.nbytes


def _write_one(engine: ByteEngine, tensor: SourceTensor, out: BinaryIO, offset: int) -> None:
    """`tensor` (rows, cols) transposed to (cols, rows) at byte `offset` of `out`, read
    TRANSPOSE_BLOCK_BYTES of its rows at a time: a block is a column slice of every output row."""
    import numpy as np

    rows, cols = tensor.shape
    itemsize = dtype_info(tensor.dtype).itemsize
    step = max(1, TRANSPOSE_BLOCK_BYTES // max(1, cols * itemsize))
    for first in range(0, rows, step):
        last = min(rows, first + step)
        data = bytearray((last - first) * cols * itemsize)
        engine.read_into(tensor, ElementRange(first * cols, last * cols), memoryview(data))
        block = np.ascontiguousarray(np.frombuffer(data, dtype=_UNSIGNED[itemsize]).reshape(last - first, cols).T)
        if first == 0 and last == rows:  # the whole tensor in one block
            out.seek(offset)
            out.write(block.data)
            continue
        for column in range(cols):
            out.seek(offset + (column * rows + first) * itemsize)
            out.write(block[column].data)
