"""crc32 (zlib's, computed by zlib-ng: tens of GB/s where the zlib a Python links may manage
one) and casts between float dtypes of raw little-endian bytes (`cast_into`; numpy, imported on
first cast only), rounding as docs/checkpoint-format.md's "Full checkpoints" says, BF16 from F32
bits like c10's `round_to_nearest_even` (NaN -> 0x7FC0). No I/O, but for the few bytes of
padding between the tensors of a storage (`check_parts`), read to check the storage's CRC-32.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from zlib_ng.zlib_ng import crc32, crc32_combine

from ...dtypes import dtype_info
from ...errors import DataCheckError

__all__ = ["PartRead", "StorageSpan", "cast_into", "check_parts", "crc32", "crc32_combine", "mismatch"]

CAST_BLOCK = 1 << 20  # elements per block
STORAGE_GAP_BYTES = 1 << 20  # bytes of a storage between the tensors read that are read to check it (padding)


class StorageSpan(NamedTuple):
    """The data of a zip record (a torch.save storage) that holds the pieces of one or more
    tensors: `nbytes` at `offset` of its file, and the CRC-32 the zip records for them."""

    key: str
    offset: int
    nbytes: int
    crc32: int


class PartRead(NamedTuple):
    """Bytes [begin, end) of a source piece (at `offset` of `path`, `nbytes` long, stored crc32
    `crc32`) read by one engine, and their crc32 (`running`)."""

    path: Path
    offset: int
    nbytes: int
    crc32: int | None
    label: str
    begin: int
    end: int
    running: int
    storage: bool = False  # bytes [begin, end) of a storage (`StorageSpan`) that holds several tensors' pieces


def check_parts(parts: list[PartRead]) -> None:
    """The parts of each source piece, read by one engine or several, must cover it from its
    first byte to its last, and their crc32s, combined, equal its stored one. A storage's parts
    (`storage`) are checked against its CRC-32 where they cover it (the padding between them, up
    to STORAGE_GAP_BYTES each, read here); one read only in part is not checked."""
    by_piece: dict[tuple[Path, int], list[PartRead]] = {}
    by_storage: dict[tuple[Path, int], list[PartRead]] = {}
    for part in parts:
        (by_storage if part.storage else by_piece).setdefault((part.path, part.offset), []).append(part)
    for reads in by_storage.values():
        _check_storage(sorted(reads, key=lambda part: (part.begin, part.end)))
    for pieces in by_piece.values():
        pieces.sort(key=lambda part: part.begin)
        crc, done = 0, 0
        for part in pieces:
            if part.begin != done:
                raise AssertionError(f"{part.label}: bytes [{done}, {part.begin}) never read")
            crc, done = crc32_combine(crc, part.running, part.end - part.begin), part.end
        piece = pieces[0]
        if done != piece.nbytes:
            raise AssertionError(f"{piece.label}: read only up to byte {done}")
        if piece.crc32 is not None and crc != piece.crc32:
            raise DataCheckError(f"{piece.path}: {mismatch(piece.label, piece.crc32, crc)}")


def _check_storage(reads: list[PartRead]) -> None:
    """`reads` (sorted) of one storage: their crc32s and those of the gaps between them, combined,
    against the storage's CRC-32, where they cover it whole (but gaps of padding)."""
    first = reads[0]
    covered: list[tuple[int, int, int | None]] = []  # [begin, end) in order and its crc32 (None: padding, read below)
    done = 0
    for read in reads:
        if read.end <= done:
            continue  # the same bytes read again (a tied weight)
        if read.begin < done or read.begin - done > STORAGE_GAP_BYTES:
            return  # overlapping reads of different extents, or not read whole here: nothing to combine
        if read.begin > done:
            covered.append((done, read.begin, None))
        covered.append((read.begin, read.end, read.running))
        done = read.end
    if first.nbytes - done > STORAGE_GAP_BYTES:
        return
    if first.nbytes > done:
        covered.append((done, first.nbytes, None))
    padding = iter(_gap_crcs(first.path, first.offset, [(begin, end) for begin, end, found in covered if found is None]))
    crc = 0
    for begin, end, found in covered:
        crc = crc32_combine(crc, next(padding) if found is None else found, end - begin)
    if crc != first.crc32:
        raise DataCheckError(f"{first.path}: {first.label}: CRC-32 {crc:08x}, the zip says {first.crc32:08x} (damaged)")


def _gap_crcs(path: Path, offset: int, gaps: list[tuple[int, int]]) -> list[int]:
    """The crc32 of each gap [start, end) of the storage at `offset` of `path`."""
    if not gaps:
        return []
    from .files import close, open_regular, read_exactly

    fd, _ = open_regular(path)
    try:
        return [crc32(read_exactly(fd, end - start, offset + start, path)) for start, end in gaps]
    finally:
        close(fd)


def mismatch(label: str, stored: int, found: int) -> str:
    return f"checksum mismatch in {label}: stored crc32 {stored:08x}, data gives {found:08x} (corrupt file)"


def cast_into(src: memoryview, src_dtype: str, dst_dtype: str, out: bytearray | memoryview) -> memoryview:
    """Cast the elements in `src` (bytes of `src_dtype`) into `out`; returns the used part of `out`."""
    import numpy as np

    src_size, dst_size = dtype_info(src_dtype).itemsize, dtype_info(dst_dtype).itemsize
    count = src.nbytes // src_size
    if src.nbytes % src_size:
        raise ValueError(f"{src.nbytes} bytes is not a whole number of {src_dtype} elements")
    out_view = memoryview(out)[: count * dst_size]
    if src_dtype == dst_dtype:
        out_view[:] = src
        return out_view
    src_array = np.frombuffer(src, dtype=np.uint8)
    out_array = np.frombuffer(out_view, dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is the intended result, as in torch
        for first in range(0, count, CAST_BLOCK):
            last = min(first + CAST_BLOCK, count)
            block = src_array[first * src_size : last * src_size]
            _cast_block(np, block, src_dtype, dst_dtype, out_array[first * dst_size : last * dst_size])
    return out_view


def _to_f32(np, src, dtype: str):
    """F32 values of `src` (raw bytes): a view when already F32, else a new array."""
    if dtype == "BF16":
        return (src.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "F32":
        return src.view(np.float32)
    return src.view(_numpy_float(np, dtype)).astype(np.float32)


def _numpy_float(np, dtype: str):
    return {"F16": np.float16, "F32": np.float32, "F64": np.float64}[dtype]


def _f32_to_bf16_into(np, values, out) -> None:
    """Round F32 `values` to nearest even BF16 bits in `out` (uint16), NaN -> 0x7FC0; one temporary."""
    bits = values.view(np.uint32)
    rounded = bits >> 16
    rounded &= 1
    rounded += np.uint32(0x7FFF)
    rounded += bits  # wraps only for negative NaNs, fixed below
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        out[nan] = 0x7FC0


def _cast_block(np, src, src_dtype: str, dst_dtype: str, out) -> None:
    """Cast raw bytes `src` into raw bytes `out` (both uint8 arrays of matching element counts)."""
    if dst_dtype == "BF16":
        _f32_to_bf16_into(np, _to_f32(np, src, src_dtype), out.view(np.uint16))
    elif src_dtype == "BF16" or (src_dtype, dst_dtype) == ("F64", "F16"):  # F64 through F32, as torch rounds (twice)
        np.copyto(out.view(_numpy_float(np, dst_dtype)), _to_f32(np, src, src_dtype), casting="unsafe")
    else:
        np.copyto(out.view(_numpy_float(np, dst_dtype)), src.view(_numpy_float(np, src_dtype)), casting="unsafe")
