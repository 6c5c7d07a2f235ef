"""One `torch.save` file (a DeepSpeed rank file, a per-rank state dict) read without torch: its
`data.pkl` through a format's allow-list unpickler, its storages (stored records
`<archive>/data/<key>`, each with the zip's CRC-32) as byte ranges of the file, which the byte
engine reads when asked.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import DataCheckError
from ...flat_layout import ElementRange
from ..format.bytecopy import SourceTensor
from ..format.crc import crc32
from ..format.files import open_regular, read_exactly
from ..format.names import numel
from ..format.report import VerifyReport
from .unpickler import TensorRecord
from .zipread import record_start, tensor_bytes, torch_save_pickle

CRC_BLOCK = 1 << 20


@dataclass(frozen=True)
class StorageEntry:
    offset: int  # absolute byte offset of the storage's first byte in the file
    nbytes: int
    crc32: int  # the zip's CRC-32 of the entry (0: torch.save wrote none)


@dataclass(frozen=True)
class TensorRange:
    path: Path
    offset: int  # absolute byte offset of element 0
    numel: int
    dtype: str


class SaveFile:
    """An open `torch.save` file: `state` (the unpickled tree, tensors as `TensorRecord`s), storages."""

    def __init__(self, path: Path, unpickle: Callable[..., Any]):
        """`unpickle(raw, where=...)`: the allow-list unpickler of its data.pkl."""
        self.path = path
        self._unpickle = unpickle
        self.fd, self.size = open_regular(path)
        try:
            self.state, self.storages = self._read()
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _read(self) -> tuple[Any, dict[str, StorageEntry]]:
        where = str(self.path)
        try:
            archive, prefix, raw = torch_save_pickle(self.fd, self.path, 0, self.size, where)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
            raise DataCheckError(f"{where}: not a readable torch.save zip ({str(error)[:80]}; truncated?)") from None
        storages = {}
        for info in archive.infolist():
            start = record_start(self.fd, self.path, 0, self.size, info, where)
            if info.filename.startswith(f"{prefix}data/"):
                storages[info.filename[len(f"{prefix}data/") :]] = StorageEntry(start, info.file_size, info.CRC)
        return self._unpickle(raw, where=f"{where} data.pkl"), storages

    def tensor_range(self, record: Any, what: str) -> TensorRange:
        """Where a contiguous tensor's elements lie in this file (checked inside its storage)."""
        where = f"{self.path}: {what}"
        if not isinstance(record, TensorRecord):
            raise DataCheckError(f"{where}: expected a tensor, found {type(record).__name__}")
        entry = self.storages.get(record.storage.key)
        if entry is None:
            raise DataCheckError(f"{where}: storage {record.storage.key!r} is missing from the zip")
        dtype, skip, _ = tensor_bytes(record, entry.nbytes, where)
        return TensorRange(self.path, entry.offset + skip, numel(record.shape), dtype)

    def crc_problems(self) -> tuple[int, list[str]]:
        """(storages checked against the zip's CRC-32, one line per mismatch)."""
        checked, problems = 0, []
        for key, entry in self.storages.items():
            if entry.crc32 == 0 and entry.nbytes > 0:
                continue
            value, position = 0, entry.offset
            while position < entry.offset + entry.nbytes:
                count = min(CRC_BLOCK, entry.offset + entry.nbytes - position)
                value = crc32(read_exactly(self.fd, count, position, self.path), value)
                position += count
            checked += 1
            if value != entry.crc32:
                problems.append(f"{self.path}: storage {key!r}: CRC-32 {value:08x}, the zip says {entry.crc32:08x} (damaged)")
        return checked, problems


def verify_saved_files(report: VerifyReport, directory: Path, sources: list[SourceTensor], opened: list[SaveFile]) -> VerifyReport:
    """`report` of the `torch.save` files `opened` holding `sources`: every storage against the
    zip's CRC-32 and every tensor covered exactly once, in order; what a format checks besides
    (its files present, its records read) it adds to `report.checked` after these."""
    problems, storages = [], 0
    for source in sources:
        position = 0
        for piece in sorted(source.pieces_in(ElementRange(0, source.numel)), key=lambda p: p.range.start):
            if piece.range.start != position:
                what = "overlap" if piece.range.start < position else "gap"
                problems.append(f"{directory}: {source.name!r}: {what} at element {min(position, piece.range.start)}")
                break
            position = piece.range.end
        else:
            if position != source.numel:
                problems.append(f"{directory}: {source.name!r}: covered up to element {position} of {source.numel}")
    for rank_file in opened:
        count, found = rank_file.crc_problems()
        storages += count
        problems.extend(found)
    report.ok, report.problems, report.tensors, report.bytes = not problems, problems, len(sources), sum(s.nbytes for s in sources)
    report.counts = {"file": len(opened), "storage": storages}
    report.checked = [
        "every data.pkl through the allow-list unpickler",
        "every tensor inside its storage",
        f"{storages} storages against the zip's CRC-32",
    ]
    return report
