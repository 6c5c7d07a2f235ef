"""crc32 arithmetic (zlib's crc32, pure Python, no I/O).

`zlib.crc32` is affine in its input, so for byte strings A and B
`crc(A + B) = shift(crc(A), len(B)) ^ crc(B)` (zlib's crc32_combine), where `shift(c, n)`
multiplies `c` by x^(8n) modulo the crc polynomial. The copy paths checksum each block of
bytes once and combine: the crc32 of a source fragment from the crc32s of the pieces it was
cut into, or of an output fragment from the blocks it was assembled from.

`shift(c, n)` is linear in `c`, so `CrcShifter` turns it, for a length it sees often, into four
lookups in 256-entry tables; other lengths cost one polynomial multiplication.

Casts between float dtypes of raw little-endian bytes (`cast_into`; numpy, imported on first
cast only), rounding as torch does: round to nearest even, BF16 from F32 bits like c10's
`round_to_nearest_even` (NaN -> 0x7FC0), F64 -> BF16 or F16 through F32.
"""

from __future__ import annotations

from ..dtypes import dtype_info

POLY = 0xEDB88320  # zlib's reflected crc32 polynomial
_TOP = 1 << 31  # the polynomial "1" in reflected bit order
TABLES_AFTER = 8  # a length shifted this many times gets lookup tables
MAX_TABLES = 512  # lengths with tables (about 40 KB each)


def multmodp(a: int, b: int) -> int:
    """a * b modulo the crc polynomial (reflected bit order, as zlib)."""
    mask, product = _TOP, 0
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _powers() -> tuple[int, ...]:
    """x^(2^k) mod P for k = 0..31."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = multmodp(p, p)
    return tuple(table)


X2N = _powers()


def x8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P."""
    result, k, n = _TOP, 3, nbytes
    while n:
        if n & 1:
            result = multmodp(X2N[k & 31], result)
        n >>= 1
        k += 1
    return result


def shift_tables(multiplier: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """For each byte k of a crc, the products of `multiplier` with every value of that byte."""
    tables = []
    for k in range(4):
        table = [0] * 256
        for bit in range(8):
            image, size = multmodp(multiplier, 1 << (8 * k + bit)), 1 << bit
            for low in range(size):
                table[size + low] = table[low] ^ image
        tables.append(table)
    return tables[0], tables[1], tables[2], tables[3]


class CrcShifter:
    """`shift(crc, n)` = crc * x^(8n) mod P; `combine(crc(A), crc(B), len(B))` = crc(A + B)."""

    def __init__(self) -> None:
        self._multipliers: dict[int, list[int]] = {}  # length -> [multiplier, uses]
        self.tables: dict[int, tuple] = {}  # length -> the four tables of shift(., length), for inlining

    def shift(self, crc: int, nbytes: int) -> int:
        tables = self.tables.get(nbytes)
        if tables is None:
            return self._shift_slowly(crc, nbytes)
        t0, t1, t2, t3 = tables
        return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]

    def _shift_slowly(self, crc: int, nbytes: int) -> int:
        entry = self._multipliers.get(nbytes)
        if entry is None:
            entry = self._multipliers[nbytes] = [x8n(nbytes), 0]
        entry[1] += 1
        if entry[1] >= TABLES_AFTER and len(self.tables) < MAX_TABLES:
            self.tables[nbytes] = shift_tables(entry[0])
        return multmodp(entry[0], crc)

    def combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        """crc(A + B) from crc(A), crc(B) and len(B)."""
        return self.shift(crc_a, len_b) ^ crc_b


CAST_BLOCK = 1 << 20  # elements per block


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
        values = src.view(np.float64).astype(np.float32) if src_dtype == "F64" else _to_f32(np, src, src_dtype)
        _f32_to_bf16_into(np, values, out.view(np.uint16))
    elif src_dtype == "BF16":
        np.copyto(out.view(_numpy_float(np, dst_dtype)), _to_f32(np, src, src_dtype), casting="unsafe")
    elif src_dtype == "F64" and dst_dtype == "F16":  # through F32, as torch rounds (twice)
        np.copyto(out.view(np.float16), src.view(np.float64).astype(np.float32), casting="unsafe")
    else:
        np.copyto(out.view(_numpy_float(np, dst_dtype)), src.view(_numpy_float(np, src_dtype)), casting="unsafe")
