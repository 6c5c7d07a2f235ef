"""crc32 arithmetic (zlib's polynomial) without rereading bytes: shifting and combining.

`zlib.crc32` is affine in its input, so for byte strings A and B:

    crc(A + B) = shift(crc(A), len(B)) ^ crc(B)      (zlib's crc32_combine)

where `shift(c, n)` multiplies `c` by x^(8n) modulo the crc polynomial. `ByteCopier` uses it
to checksum each block once and still keep two running checksums (the source fragment being
verified, the output fragment being written) when they cover different spans.
`CrcShifter` caches the multiplier per length, so a shift costs one 32-step product.
"""

from __future__ import annotations

POLY = 0xEDB88320  # zlib's reflected crc32 polynomial
_TOP = 1 << 31  # the polynomial "1" in reflected bit order


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


class CrcShifter:
    """`shift(crc, n)` = crc * x^(8n) mod P, with the multiplier of each length cached."""

    def __init__(self) -> None:
        self._multipliers: dict[int, int] = {}

    def shift(self, crc: int, nbytes: int) -> int:
        multiplier = self._multipliers.get(nbytes)
        if multiplier is None:
            multiplier = self._multipliers[nbytes] = x8n(nbytes)
        return multmodp(multiplier, crc)

    def combine(self, crc_a: int, crc_b: int, len_b: int) -> int:
        """crc(A + B) from crc(A), crc(B) and len(B)."""
        return self.shift(crc_a, len_b) ^ crc_b
