"""The one parser and the one formatter of byte sizes used by every command, and counts of things.

`K`/`M`/`G`/`T` and `KiB`/`MiB`/`GiB`/`TiB` are powers of 1024; `KB`/`MB`/`GB`/`TB` are powers
of 1000 (the Hugging Face convention, where `5GB` means 5 * 10**9 bytes). A bare number, or a
`B` suffix, is bytes.
"""

import re

from .errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024,
    "KIB": 1024,
    "KB": 1000,
    "M": 1024**2,
    "MIB": 1024**2,
    "MB": 1000**2,
    "G": 1024**3,
    "GIB": 1024**3,
    "GB": 1000**3,
    "T": 1024**4,
    "TIB": 1024**4,
    "TB": 1000**4,
}
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse '64M', '5GB', '1.5GiB', '4096' into a number of bytes (an int >= 0)."""
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"size {text} is negative")
        return text
    match = _SIZE_PATTERN.match(str(text))
    if not match:
        raise UsageError(f"cannot parse size {text!r}: expected a number with an optional unit such as 64M, 5GB or 1GiB")
    number, unit = match.groups()
    unit_key = unit.upper()
    if unit_key not in _UNITS:
        raise UsageError(f"unknown size unit {unit!r} in {text!r}: use K/M/G (=KiB/MiB/GiB, powers of 1024) or KB/MB/GB (powers of 1000)")
    value = float(number) * _UNITS[unit_key]
    if value != int(value):
        raise UsageError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(num_bytes: int) -> str:
    """Human-readable size in powers of 1024 (e.g. '1.5 GiB')."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(number: int, noun: str) -> str:
    """'1 file', '2 files', '0 files' (the plural adds an s)."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
