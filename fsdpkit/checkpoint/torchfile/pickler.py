"""Pickles written without torch (protocol 2): a tree of plain values and the records below, as
the opcodes torch's own pickles hold; the globals they name are only looked up when loaded.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Global:
    module: str
    name: str


@dataclass(frozen=True)
class Reduce:
    """`callable(*args)` when loaded."""

    function: Global
    args: tuple


@dataclass(frozen=True)
class Raw:
    """Bytes already pickled."""

    data: bytes


@dataclass(frozen=True)
class Pairs:
    """A dict given as its (key, value) pairs, made as they are written (the keys here are
    records, not hashable; a large checkpoint has a million objects, never all alive)."""

    items: Iterable[tuple[Any, Any]]


class Ordered(Pairs):
    """An `collections.OrderedDict` of `items` (pairs), in their order."""


@dataclass(frozen=True)
class NewObject:
    """`cls.__new__(cls)` given `state` by pickle's BUILD (`__setstate__`, else its `__dict__`)."""

    cls: Global
    state: Any


def pickled_text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw


def pickled_int(value: int) -> bytes:
    if 0 <= value < 256:
        return b"K" + bytes([value])
    if 0 <= value < 65536:
        return b"M" + struct.pack("<H", value)
    if -(2**31) <= value < 2**31:
        return b"J" + struct.pack("<i", value)
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def emit(value: Any, out: bytearray) -> None:
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"\x88" if value else b"\x89"
    elif isinstance(value, int):
        out += pickled_int(value)
    elif isinstance(value, float):
        out += b"G" + struct.pack(">d", value)
    elif isinstance(value, str):
        out += pickled_text(value)
    elif isinstance(value, (tuple, list)):
        out += b"(" if isinstance(value, tuple) else b"]("
        for item in value:
            emit(item, out)
        out += b"t" if isinstance(value, tuple) else b"e"
    elif isinstance(value, (dict, Pairs)):
        out += b"ccollections\nOrderedDict\n)R(" if isinstance(value, Ordered) else b"}("
        for key, item in value.items() if isinstance(value, dict) else value.items:
            emit(key, out)
            emit(item, out)
        out += b"u"
    elif isinstance(value, Raw):
        out += value.data
    elif isinstance(value, Global):
        out += f"c{value.module}\n{value.name}\n".encode()
    elif isinstance(value, Reduce):
        emit(value.function, out)
        emit(value.args, out)
        out += b"R"
    elif isinstance(value, NewObject):
        emit(value.cls, out)
        out += b")\x81"  # NEWOBJ with no arguments
        emit(value.state, out)
        out += b"b"
    else:
        raise TypeError(f"cannot pickle {type(value).__name__} here")


def dumps(value: Any, *, memo: bytes = b"") -> bytes:
    """`value` pickled; `memo`: opcodes that put what the value repeats in pickle's memo first."""
    out = bytearray(b"\x80\x02" + memo)
    emit(value, out)
    out += b"."
    return bytes(out)
