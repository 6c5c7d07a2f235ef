"""crc32 arithmetic (zlib's crc32, pure Python, no I/O).

`zlib.crc32` is affine in its input, so for byte strings A and B
`crc(A + B) = shift(crc(A), len(B)) ^ crc(B)` (zlib's crc32_combine), where `shift(c, n)`
multiplies `c` by x^(8n) modulo the crc polynomial. The copy paths checksum each block of
bytes once and combine: the crc32 of a source fragment from the crc32s of the pieces it was
cut into, or of an output fragment from the blocks it was assembled from.

`shift(c, n)` is linear in `c`, so `CrcShifter` turns it, for a length it sees often, into four
lookups in 256-entry tables (a quarter of a microsecond); other lengths cost one polynomial
multiplication (a few microseconds).
"""

from __future__ import annotations

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
