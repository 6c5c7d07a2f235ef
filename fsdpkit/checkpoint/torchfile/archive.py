"""`torch.save` zip archives written without torch: the records' headers, and one tensor as a
whole archive (what DCP's reader `torch.load`s for each chunk of the torch_save serialization):
stored records `archive/data.pkl` (`_rebuild_tensor_v2(storage, 0, shape, stride, False,
OrderedDict())`, or `_v3` with an untyped storage and the dtype for dtypes without a legacy
storage class), `.format_version`, `.storage_alignment`, `byteorder`, `data/0` (the raw
little-endian bytes, aligned to 64 bytes from the archive's start), `version`,
`.data/serialization_id`. The data is copied from the source straight into the file between
the `archive_parts`; its crc32 is 0, as torch.save writes it with crc32 off: torch.load does
not check it, and computing it would read every byte in user space.

A record of 4 GiB or more, or one that starts 4 GiB or more into the archive, is written as
zip64 (APPNOTE 4.5.3): its sizes, in its local header and its data descriptor too, and its
offset, in the central directory, go in a zip64 extra field; an archive whose central directory
starts 4 GiB or more in (or that has 65,535 records or more) ends with a zip64 end of central
directory record and its locator before the end record. torch.load, Python's zipfile and
`unzip` read them.

`torch_zip_parts` with the storages' CRC-32s (a DeepSpeed rank file) writes each storage's
record as a zip written as a stream does: its local header, before the data, says that a data
descriptor follows the data, and the descriptor and the central directory carry the CRC-32,
computed as the bytes go out (`zipfile`, `unzip -t` and `fsdpkit verify` check it).
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from collections.abc import Sequence

from ...dtypes import dtype_info
from .pickler import pickled_int, pickled_text
from .unpickler import STORAGE_DTYPES, TORCH_DTYPE_NAMES

ALIGNMENT = 64
ZIP32_LIMIT = 0xFFFFFFFF  # a size or offset this large or larger is written as zip64
ZIP32_RECORDS = 0xFFFF  # as many records or more: a zip64 end record
IN_ZIP64 = 0xFFFFFFFF  # a 4-byte field whose value is in the zip64 extra field or end record
RECORDS_IN_ZIP64 = 0xFFFF  # the end record's 2-byte counts, likewise
LEGACY_STORAGE_NAMES = {dtype: name for name, dtype in STORAGE_DTYPES.items()}
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
END_RECORD = struct.Struct("<IHHHHIIH")
ZIP64_END_RECORD = struct.Struct("<IQHHIIQQQQ")
ZIP64_LOCATOR = struct.Struct("<IIQI")
ZIP64_EXTRA_ID = 0x0001
ZIP64_VERSION = 45  # version needed to extract a zip64 record
DATA_DESCRIPTOR = struct.Struct("<IIII")  # signature, CRC-32, compressed and uncompressed size
ZIP64_DATA_DESCRIPTOR = struct.Struct("<IIQQ")  # the same, of a zip64 record
FOLLOWED_BY_DESCRIPTOR = 0x08  # general purpose flag bit 3: CRC-32 and sizes follow the data
_PAD_ID = 0x4246  # the extra field torch pads records with ("FB")


def _ints(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(pickled_int(v) for v in values) + b"t" if values else b")"


def tensor_pickle(dtype: str, key: str, shape: tuple[int, ...]) -> bytes:
    """The pickle opcodes of a contiguous tensor of `dtype` and `shape` filling storage `key` from its start."""
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    numel = math.prod(shape)
    legacy = LEGACY_STORAGE_NAMES.get(dtype)
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n" if legacy else b"ctorch._utils\n_rebuild_tensor_v3\n"
    storage_class = f"ctorch\n{legacy}\n" if legacy else "ctorch.storage\nUntypedStorage\n"
    count = numel if legacy else numel * dtype_info(dtype).itemsize
    storage = b"(" + pickled_text("storage") + storage_class.encode() + pickled_text(key) + pickled_text("cpu") + pickled_int(count) + b"tQ"
    hooks = b"ccollections\nOrderedDict\n)R"
    tail = b"" if legacy else f"ctorch\n{TORCH_DTYPE_NAMES[dtype]}\n".encode()
    arguments = storage + pickled_int(0) + _ints(shape) + _ints(stride) + b"\x89" + hooks + tail
    return rebuild + b"(" + arguments + b"tR"


def local_header(name: bytes, crc: int, size: int, position: int, flags: int = 0) -> bytes:
    """A local header whose data starts aligned; its extra field pads (after the zip64 sizes of a
    record of ZIP32_LIMIT bytes or more)."""
    zip64 = struct.pack("<HHQQ", ZIP64_EXTRA_ID, 16, size, size) if size >= ZIP32_LIMIT else b""
    bare = position + _LOCAL.size + len(name) + len(zip64)
    pad = (-(bare + 4)) % ALIGNMENT
    extra = zip64 + struct.pack("<HH", _PAD_ID, pad) + b"Z" * pad
    version, field = ZIP64_VERSION if zip64 else 0, _field(size)
    return _LOCAL.pack(0x04034B50, version, flags, 0, 0, 0, crc, field, field, len(name), len(extra)) + name + extra


def _field(value: int) -> int:
    """What a 4-byte size or offset field holds for `value`: it, or IN_ZIP64 (the value is in a zip64 record)."""
    return IN_ZIP64 if value >= ZIP32_LIMIT else value


def data_descriptor(crc: int, size: int) -> bytes:
    """What follows the data of a record whose local header has FOLLOWED_BY_DESCRIPTOR (its sizes
    in 8 bytes each for a zip64 record); its length depends on `size` only."""
    if size >= ZIP32_LIMIT:
        return ZIP64_DATA_DESCRIPTOR.pack(0x08074B50, crc, size, size)
    return DATA_DESCRIPTOR.pack(0x08074B50, crc, size, size)


@functools.lru_cache(maxsize=4096)
def archive_parts(dtype: str, shape: tuple[int, ...], nbytes: int) -> tuple[bytes, bytes]:
    """(bytes before the tensor data, bytes after it) of the archive."""
    head, tail = torch_zip_parts("archive", b"\x80\x02" + tensor_pickle(dtype, "0", shape) + b".", [nbytes])
    return head, tail


def torch_zip_parts(prefix: str, data_pkl: bytes, sizes: Sequence[int], crcs: Sequence[int] | None = None) -> list[bytes]:
    """The bytes of a `torch.save` archive around its storages' data (`sizes[key]` bytes each, in
    records `<prefix>/data/<key>`): part `key` goes before storage `key`'s data, the last part after
    the last storage's. `crcs` None: the storages' records carry CRC-32 0 (torch.save with crc32
    off); else `crcs[key]`, in a data descriptor after the data (it starts part `key + 1`) and
    in the central directory (the parts' sizes do not depend on the values)."""
    records: list[tuple[str, bytes | int]] = [("data.pkl", data_pkl), (".format_version", b"1"), (".storage_alignment", b"64")]
    records += [("byteorder", b"little"), *((f"data/{key}", size) for key, size in enumerate(sizes))]
    records += [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]
    flags = 0 if crcs is None else FOLLOWED_BY_DESCRIPTOR
    parts, central, position = [bytearray()], bytearray(), 0
    for record, payload in records:
        name = f"{prefix}/{record}".encode()
        if isinstance(payload, int):  # a storage's record: its data comes from the source, between the parts
            crc = 0 if crcs is None else crcs[len(parts) - 1]
            central += central_header(name, crc, payload, position, flags)
            header = local_header(name, 0, payload, position, flags)
            parts[-1] += header
            parts.append(bytearray() if crcs is None else bytearray(data_descriptor(crc, payload)))
            position += len(header) + payload + len(parts[-1])
        else:
            crc = zlib.crc32(payload)
            central += central_header(name, crc, len(payload), position)
            header = local_header(name, crc, len(payload), position)
            parts[-1] += header + payload
            position += len(header) + len(payload)
    parts[-1] += central + end_records(len(records), len(central), position)
    return [bytes(part) for part in parts]


def central_header(name: bytes, crc: int, size: int, offset: int, flags: int = 0) -> bytes:
    """The central directory's entry of a stored record whose local header is at `offset` (a size or
    offset of ZIP32_LIMIT or more in its zip64 extra field)."""
    zip64 = struct.pack("<QQ", size, size) if size >= ZIP32_LIMIT else b""
    zip64 += struct.pack("<Q", offset) if offset >= ZIP32_LIMIT else b""
    extra = struct.pack("<HH", ZIP64_EXTRA_ID, len(zip64)) + zip64 if zip64 else b""
    version, field = ZIP64_VERSION if zip64 else 0, _field(size)
    header = _CENTRAL.pack(
        0x02014B50, version, version, flags, 0, 0, 0, crc, field, field, len(name), len(extra), 0, 0, 0, 0, _field(offset)
    )
    return header + name + extra


def end_records(count: int, central_size: int, central_offset: int) -> bytes:
    """The end of an archive whose central directory of `count` records, `central_size` bytes, starts
    at `central_offset`: the end record, after a zip64 end record and its locator when a value does
    not fit the end record's fields."""
    if count < ZIP32_RECORDS and central_size < ZIP32_LIMIT and central_offset < ZIP32_LIMIT:
        return END_RECORD.pack(0x06054B50, 0, 0, count, count, central_size, central_offset, 0)
    at = central_offset + central_size
    zip64 = ZIP64_END_RECORD.pack(
        0x06064B50, ZIP64_END_RECORD.size - 12, ZIP64_VERSION, ZIP64_VERSION, 0, 0, count, count, central_size, central_offset
    )
    locator = ZIP64_LOCATOR.pack(0x07064B50, 0, at, 1)
    records = RECORDS_IN_ZIP64 if count >= ZIP32_RECORDS else count
    return zip64 + locator + END_RECORD.pack(0x06054B50, 0, 0, records, records, _field(central_size), _field(central_offset), 0)
