"""DeepSpeed's rank files as `torch.save` zips of many storages (`torchfile.archive`), written
without torch: each storage filled straight into the file from its sources' byte ranges, cast
where the output's dtype differs. Archives of 4 GiB or more need zip64, which is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...dtypes import dtype_info
from ...errors import UsageError
from ..format.bytecopy import SourceTensor
from ..torchfile.archive import MAX_RECORD_BYTES, torch_zip_parts
from ..torchfile.pickler import Raw
from ..torchfile.rawout import RawOutput
from . import writer_records as records
from .partition import Segment


@dataclass(frozen=True)
class Storage:
    nbytes: int
    fill: Callable[[RawOutput], None]  # appends exactly `nbytes`


class StoragePickle:
    """A data.pkl under construction: its storages, in the order they are named."""

    def __init__(self) -> None:
        self.storages: list[Storage] = []

    def tensor(self, storage: Storage, shape: tuple[int, ...], dtype: str = "F32") -> Raw:
        self.storages.append(storage)
        return records.tensor(dtype, len(self.storages) - 1, shape)


def segment_storage(sources: dict[str, SourceTensor], segments: tuple[Segment, ...], dtype: str = "F32") -> Storage:
    """The segments' elements of `sources` as `dtype`, and the zeros of the padding segments."""
    itemsize = dtype_info(dtype).itemsize

    def fill(out: RawOutput) -> None:
        for segment in segments:
            if segment.name is None:
                out.write(bytes(itemsize * segment.elements.size))
            elif sources[segment.name].dtype == dtype:
                out.copy(sources[segment.name], segment.elements)
            else:
                out.copy_via_engine(sources[segment.name], segment.elements, dtype)

    return Storage(itemsize * sum(s.elements.size for s in segments), fill)


def write_torch_zip(out: RawOutput, prefix: str, data_pkl: bytes, storages: list[Storage]) -> None:
    """The archive, as the whole of `out` (written from its start)."""
    total = len(data_pkl) + sum(s.nbytes for s in storages) + 4096 * (len(storages) + 8)
    if total > MAX_RECORD_BYTES:
        raise UsageError(f"{out.path}: a rank file of about {total} bytes (4 GiB or more) needs zip64, which fsdpkit does not write")
    parts = torch_zip_parts(prefix, data_pkl, [s.nbytes for s in storages])
    for key, storage in enumerate(storages):
        out.write(parts[key])
        start = out.position
        storage.fill(out)
        if out.position - start != storage.nbytes:
            raise AssertionError(f"{out.path}: storage {key} took {out.position - start} bytes, not {storage.nbytes}")
    out.write(parts[-1])
