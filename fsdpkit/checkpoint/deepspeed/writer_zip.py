"""A `torch.save` zip archive of many storages, written without torch: `data.pkl`, then one
uncompressed `data/<key>` record per storage (64-byte aligned, filled by the caller straight
into the file from its sources' byte ranges, cast where the output's dtype differs), then
torch's trailing records and the central directory. Like `torchfile.archive`, data records
carry crc32 0 (torch.load does not check it); archives of 4 GiB or more need zip64, which is
refused.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from ...dtypes import dtype_info
from ...errors import UsageError
from ...flat_layout import ElementRange
from ..format.bytecopy import ByteEngine, SourceTensor
from ..format.crc import cast_into
from ..torchfile.archive import END_RECORD, MAX_RECORD_BYTES, central_header, local_header
from ..torchfile.pickler import Raw
from ..torchfile.rawout import RawOutput
from . import writer_records as records
from .partition import Segment

CAST_ELEMENTS = 1 << 20  # elements read and cast at a time


@dataclass(frozen=True)
class Storage:
    nbytes: int
    fill: Callable[[RawOutput, ByteEngine], None]  # appends exactly `nbytes`, reading sources through the engine


class StoragePickle:
    """A data.pkl under construction: its storages, in the order they are named."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []

    def tensor(self, storage: Storage, shape: tuple[int, ...], dtype: str = "F32") -> Raw:
        self.storages.append(storage)
        return records.tensor(dtype, len(self.storages) - 1, shape)


def _cast(out: RawOutput, engine: ByteEngine, source: SourceTensor, wanted: ElementRange, dtype: str) -> None:
    for first in range(wanted.start, wanted.end, CAST_ELEMENTS):
        chunk = ElementRange(first, min(first + CAST_ELEMENTS, wanted.end))
        data = memoryview(bytearray(chunk.size * dtype_info(source.dtype).itemsize))
        engine.read_into(source, chunk, data)
        out.write(cast_into(data, source.dtype, dtype, bytearray(chunk.size * dtype_info(dtype).itemsize)))


def segment_storage(sources: dict[str, SourceTensor], segments: tuple[Segment, ...], dtype: str = "F32") -> Storage:
    """The segments' elements of `sources` as `dtype`, and the zeros of the padding segments."""
    itemsize = dtype_info(dtype).itemsize

    def fill(out: RawOutput, engine: ByteEngine) -> None:
        for segment in segments:
            if segment.name is None:
                out.write(bytes(itemsize * segment.elements.size))
            elif sources[segment.name].dtype == dtype:
                out.copy(sources[segment.name], segment.elements)
            else:
                _cast(out, engine, sources[segment.name], segment.elements, dtype)

    return Storage(itemsize * sum(s.elements.size for s in segments), fill)


def write_torch_zip(out: RawOutput, engine: ByteEngine, prefix: str, data_pkl: bytes, storages: list[Storage]) -> None:
    """The archive, from `out`'s current position (0: the archive is the file)."""
    total = len(data_pkl) + sum(s.nbytes for s in storages) + 4096 * (len(storages) + 8)
    if total > MAX_RECORD_BYTES:
        raise UsageError(f"{out.path}: a rank file of about {total} bytes (4 GiB or more) needs zip64, which fsdpkit does not write")
    central = bytearray()

    def small(record: str, payload: bytes) -> None:
        name, crc = f"{prefix}/{record}".encode(), zlib.crc32(payload)
        central.extend(central_header(name, crc, len(payload), out.position))
        out.write(local_header(name, crc, len(payload), out.position) + payload)

    for record, payload in (("data.pkl", data_pkl), (".format_version", b"1"), (".storage_alignment", b"64"), ("byteorder", b"little")):
        small(record, payload)
    for key, storage in enumerate(storages):
        name = f"{prefix}/data/{key}".encode()
        central.extend(central_header(name, 0, storage.nbytes, out.position))
        out.write(local_header(name, 0, storage.nbytes, out.position))
        start = out.position
        storage.fill(out, engine)
        if out.position - start != storage.nbytes:
            raise AssertionError(f"{out.path}: storage {key} took {out.position - start} bytes, not {storage.nbytes}")
    small("version", b"3\n")
    small(".data/serialization_id", b"0" * 40)
    count = len(storages) + 6
    out.write(bytes(central) + END_RECORD.pack(0x06054B50, 0, 0, count, count, len(central), out.position, 0))
