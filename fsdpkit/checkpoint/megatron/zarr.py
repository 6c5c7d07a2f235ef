"""Megatron's legacy `zarr` backend (removed in 0.16) read without the zarr package (no torch):
one directory per tensor key holding `.zarray` (zarr v2 JSON: shape, chunks, dtype, order,
compressor) and one file per chunk named by its grid index (`i.j.k`), each the chunk's raw
C-order bytes; a directory holding `shard_*.pt` files instead is a sharded object, its
pickles checked by the allow-list unpickler and otherwise left alone. Uncompressed chunks of
a grid that divides the shape are read; a compressor, filters, Fortran order or a padded edge
chunk is refused in one line."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError
from ..core.boxes import flat_runs
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.files import read_regular
from ..core.names import numel
from ..torchfile.savefile import SaveFile, TensorRange
from .unpickler import loads_common

ZARRAY = ".zarray"
ZARR_DTYPES = {
    **{"<f4": "F32", "<f2": "F16", "<f8": "F64", "bfloat16": "BF16", "<V2": "BF16"},
    **{"<i8": "I64", "<i4": "I32", "|u1": "U8", "|b1": "BOOL"},
}


@dataclass(frozen=True)
class ZarrArray:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    directory: Path


def read_zarray(directory: Path) -> ZarrArray:
    where = directory / ZARRAY
    try:
        document = json.loads(read_regular(where, 1 << 20))
    except ValueError:
        raise DataCheckError(f"{where}: not JSON") from None
    shape, chunks, dtype = tuple(document.get("shape") or ()), tuple(document.get("chunks") or ()), document.get("dtype")
    compressor = document.get("compressor")
    if compressor is not None:
        named = compressor.get("id", compressor) if isinstance(compressor, dict) else compressor
        raise DataCheckError(f"{where}: chunks compressed with {named}: fsdpkit reads uncompressed zarr")
    if document.get("filters") or document.get("order", "C") != "C" or document.get("zarr_format") != 2:
        raise DataCheckError(f"{where}: filters, Fortran order or a zarr format other than 2: not read")
    if dtype not in ZARR_DTYPES:
        raise DataCheckError(f"{where}: dtype {dtype!r} is not one fsdpkit reads ({', '.join(ZARR_DTYPES)})")
    if len(chunks) != len(shape) or any(c < 1 or s % c for s, c in zip(shape, chunks, strict=True)):
        raise DataCheckError(f"{where}: chunks {list(chunks)} do not tile shape {list(shape)} (padded edge chunks are not read)")
    return ZarrArray(directory.name, ZARR_DTYPES[dtype], shape, chunks, directory)


def zarr_source(array: ZarrArray) -> SourceTensor:
    """The array's elements where its chunk files lie (each file checked to hold its chunk whole)."""
    pieces: list[SourcePiece] = []
    per_chunk = numel(array.chunks)
    grid = [range(s // c) for s, c in zip(array.shape, array.chunks, strict=True)]
    for index in itertools.product(*grid):
        path = array.directory / (".".join(map(str, index)) or "0")
        data = TensorRange(path, 0, per_chunk, array.dtype)
        expected = per_chunk * dtype_info(array.dtype).itemsize
        if not path.is_file() or path.stat().st_size != expected:
            found = path.stat().st_size if path.is_file() else "no file"
            raise DataCheckError(f"{path}: chunk {list(index)} of {array.key!r} must hold {expected} bytes, found {found}")
        offsets = tuple(i * c for i, c in zip(index, array.chunks, strict=True))
        for first, count, within in flat_runs(array.shape, offsets, array.chunks):
            pieces.append(data.piece(array.key, within, count, first))
    pieces.sort(key=lambda piece: piece.range.start)
    return SourceTensor(array.key, array.shape, array.dtype, tuple(pieces))


def zarr_tensors(weights: Path) -> tuple[dict[str, SourceTensor], list[str]]:
    """Every array of a zarr checkpoint by key, and the keys of its sharded objects."""
    tensors, objects = {}, []
    for directory in sorted(p for p in weights.iterdir() if p.is_dir()):
        if (directory / ZARRAY).is_file():
            tensors[directory.name] = zarr_source(read_zarray(directory))
        elif any(directory.glob("shard_*.pt")):
            objects.append(directory.name)
            for shard in sorted(directory.glob("shard_*.pt")):  # through the allow-list: a pickle naming another global is refused
                SaveFile(shard, loads_common).close()
    if not tensors:
        raise DataCheckError(f"{weights}: a zarr checkpoint without any array")
    return tensors, objects
