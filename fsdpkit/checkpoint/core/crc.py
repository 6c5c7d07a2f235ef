"""crc32 (zlib's, computed by zlib-ng: tens of GB/s where the zlib a Python links may manage
one) and casts between float dtypes of raw little-endian bytes (`cast_into`; numpy, imported on
first cast only), rounding as docs/checkpoint-format.md's "Full checkpoints" says, BF16 from F32
bits like c10's `round_to_nearest_even` (NaN -> 0x7FC0). No I/O.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from zlib_ng.zlib_ng import crc32, crc32_combine

from ...dtypes import dtype_info
from ...errors import DataCheckError

__all__ = ["PartRead", "cast_into", "check_parts", "crc32", "crc32_combine", "mismatch"]

CAST_BLOCK = 1 << 20  # elements per block


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


def check_parts(parts: list[PartRead]) -> None:
    """The parts of each source piece, read by one engine or several, must cover it from its
    first byte to its last, and their crc32s, combined, equal its stored one."""
    by_piece: dict[tuple[Path, int], list[PartRead]] = {}
    for part in parts:
        by_piece.setdefault((part.path, part.offset), []).append(part)
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
