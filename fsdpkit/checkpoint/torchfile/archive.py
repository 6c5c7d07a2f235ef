"""`torch.save` zip archives written without torch: the records' headers, and one tensor as a
whole archive (what DCP's reader `torch.load`s for each chunk of the torch_save serialization):
stored records `archive/data.pkl` (`_rebuild_tensor_v2(storage, 0, shape, stride, False,
OrderedDict())`, or `_v3` with an untyped storage and the dtype for dtypes without a legacy
storage class), `.format_version`, `.storage_alignment`, `byteorder`, `data/0` (the raw
little-endian bytes, aligned to 64 bytes from the archive's start), `version`,
`.data/serialization_id`. The data is copied from the source straight into the file between
the `archive_parts`; its crc32 is 0, as torch.save writes it with crc32 off: torch.load does
not check it, and computing it would read every byte in user space. Chunks of 4 GiB or more
need zip64 and are refused.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib

from ...dtypes import dtype_info
from ...errors import UsageError
from .pickler import pickled_int, pickled_text
from .unpickler import STORAGE_DTYPES, TORCH_DTYPE_NAMES

ALIGNMENT = 64
MAX_RECORD_BYTES = 0xFFFFFFFF
LEGACY_STORAGE_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
END_RECORD = struct.Struct("<IHHHHIIH")
_PAD_ID = 0x4246  # the extra field torch pads records with ("FB")


def _ints(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(pickled_int(v) for v in values) + b"t" if values else b")"


def data_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The data.pkl of a contiguous tensor of `dtype` and `shape` in storage "0"."""
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    numel = math.prod(shape)
    legacy = LEGACY_STORAGE_NAMES.get(dtype)
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n" if legacy else b"ctorch._utils\n_rebuild_tensor_v3\n"
    storage_class = f"ctorch\n{legacy}\n" if legacy else "ctorch.storage\nUntypedStorage\n"
    count = numel if legacy else numel * dtype_info(dtype).itemsize
    storage = b"(" + pickled_text("storage") + storage_class.encode() + pickled_text("0") + pickled_text("cpu") + pickled_int(count) + b"tQ"
    hooks = b"ccollections\nOrderedDict\n)R"
    tail = b"" if legacy else f"ctorch\n{TORCH_DTYPE_NAMES[dtype]}\n".encode()
    arguments = storage + pickled_int(0) + _ints(shape) + _ints(stride) + b"\x89" + hooks + tail
    return b"\x80\x02" + rebuild + b"(" + arguments + b"tR."


def local_header(name: bytes, crc: int, size: int, position: int) -> bytes:
    """A local header whose data starts aligned; its extra field pads."""
    bare = position + _LOCAL.size + len(name)
    pad = (-(bare + 4)) % ALIGNMENT
    extra = struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    return _LOCAL.pack(0x04034B50, 0, 0, 0, 0, 0, crc, size, size, len(name), len(extra)) + name + extra


@functools.lru_cache(maxsize=4096)
def archive_parts(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[bytes, bytes]:
    """(bytes before the tensor data, bytes after it) of the archive."""
    if nbytes > MAX_RECORD_BYTES:
        raise UsageError(
            f"a DCP chunk of {nbytes} bytes (4 GiB or more) needs zip64, which fsdpkit does not write; use a larger --world-size"
        )
    records = [
        ("data.pkl", data_pickle(dtype, shape)),
        (".format_version", b"1"),
        (".storage_alignment", b"64"),
        ("byteorder", b"little"),
        ("data/0", None),
        ("version", b"3\n"),
        (".data/serialization_id", b"0" * 40),
    ]
    head, tail, central = bytearray(), bytearray(), bytearray()
    out, base = head, 0  # records before the data go into head, those after it into tail, at `base`
    for record, payload in records:
        name = f"archive/{record}".encode()
        crc, size = (0, nbytes) if payload is None else (zlib.crc32(payload), len(payload))
        central += central_header(name, crc, size, base + len(out))
        out += local_header(name, crc, size, base + len(out)) + (payload or b"")
        if payload is None:  # the data record's header: its bytes come from the source
            out, base = tail, len(head) + nbytes
    end = END_RECORD.pack(0x06054B50, 0, 0, len(records), len(records), len(central), base + len(tail), 0)
    return bytes(head), bytes(tail + central + end)


def central_header(name: bytes, crc: int, size: int, offset: int) -> bytes:
    """The central directory's entry of a stored record whose local header is at `offset`."""
    return _CENTRAL.pack(0x02014B50, 0, 0, 0, 0, 0, 0, crc, size, size, len(name), 0, 0, 0, 0, 0, offset) + name
