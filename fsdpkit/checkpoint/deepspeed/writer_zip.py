"""A `torch.save` zip archive of many storages, written without torch: `data.pkl`, then one
uncompressed `data/<key>` record per storage (64-byte aligned, filled by the caller straight
into the file), then torch's trailing records and the central directory. Like
`torchfile.archive`, data records carry crc32 0 (torch.load does not check it); archives of
4 GiB or more need zip64, which is refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from ...errors import UsageError
from ..format.bytecopy import ByteEngine
from ..torchfile.archive import END_RECORD as _END
from ..torchfile.archive import MAX_RECORD_BYTES
from ..torchfile.archive import central_header as _central
from ..torchfile.archive import local_header as _local
from ..torchfile.rawout import RawOutput


@dataclass(frozen=True)
class Storage:
    nbytes: int
    fill: Callable[[RawOutput, ByteEngine], None]  # appends exactly `nbytes`, reading sources through the engine


def write_torch_zip(out: RawOutput, engine: ByteEngine, prefix: str, data_pkl: bytes, storages: list[Storage]) -> None:
    """The archive, from `out`'s current position (0: the archive is the file)."""
    total = len(data_pkl) + sum(s.nbytes for s in storages) + 4096 * (len(storages) + 8)
    if total > MAX_RECORD_BYTES:
        raise UsageError(f"{out.path}: a rank file of about {total} bytes (4 GiB or more) needs zip64, which fsdpkit does not write")
    central = bytearray()

    def small(record: str, payload: bytes) -> None:
        name, crc = f"{prefix}/{record}".encode(), zlib.crc32(payload)
        central.extend(_central(name, crc, len(payload), out.position))
        out.write(_local(name, crc, len(payload), out.position) + payload)

    for record, payload in (("data.pkl", data_pkl), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
        small(record, payload)
    for key, storage in enumerate(storages):
        name = f"{prefix}/data/{key}".encode()
        central.extend(_central(name, 0, storage.nbytes, out.position))
        out.write(_local(name, 0, storage.nbytes, out.position))
        start = out.position
        storage.fill(out, engine)
        if out.position - start != storage.nbytes:
            raise AssertionError(f"{out.path}: storage {key} took {out.position - start} bytes, not {storage.nbytes}")
    small("version", b"3\n")
    small(".data/serialization_id", b"0" * 40)
    count = len(storages) + 6
    out.write(bytes(central) + _END.pack(0x06054B50, 0, 0, count, count, len(central), out.position, 0))
