"""The one writer of checkpoint files (no torch): safetensors files whose header is laid out
from (name, dtype, shape) alone, then streamed; one rank's fragments into its rank file; and a
whole sharded checkpoint from `SourceTensor`s by range arithmetic (convert, reshard).

`StreamingWriter` pads the header with spaces to a multiple of 8 (as the safetensors library
does), writes it, then accepts the data bytes in order in any number of pieces: memory is
whatever the caller's buffer is, never a tensor. Entries are stored in the order given,
after a stable sort by descending itemsize so every tensor starts aligned to its element
size. The result reads back with `safetensors.safe_open`.

`write_behind=True` (convert, reshard) starts the writeback of every completed
`WRITE_BEHIND_BYTES` window at once (`posix_fadvise(DONTNEED)`: asynchronous writeback,
then clean pages leave the page cache; dirty data is never dropped), so the disk works while
the copy goes on and the final fsync has little left to do; it also keeps a multi-GB output
from filling the page cache. Durability is unchanged: `close()` still fsyncs.

`write_rank_file` (training saves; the engine side hands it raw bytes) writes one rank's
fragments, each with its crc32, and returns a typed `WrittenFile`. `write_sharded` (convert,
reshard) lays the sources out for a world size with `placement.rank_contents`, copies each
rank's ranges through one `ByteCopier` (bounded memory, source checksums verified on the
way, output crc32s computed from the bytes written), then writes `manifest.json`. Every rank
gets a file, possibly with no tensors.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..layout import ElementRange
from .bytecopy import ByteCopier, SourceTensor
from .format import dtype_info, numel, output_dtype, rank_file_name
from .manifest import FileEntry, FragmentEntry, Manifest, TensorEntry, manifest_problems, save_manifest
from .placement import Placement, rank_contents

WRITE_BEHIND_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Span:
    """Where one entry's data sits, relative to the start of the data buffer."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def layout_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[tuple[str, Span]]]:
    """The header bytes (length prefix included, padded to 8) and each entry's data span, in write order."""
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError(f"duplicate or reserved tensor names in one safetensors file: {names}")
    ordered = sorted(entries, key=lambda e: -dtype_info(e[1]).itemsize)  # stable: keeps caller order within a size
    document: dict[str, object] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    spans, position = [], 0
    for name, dtype, shape in ordered:
        size = numel(shape) * dtype_info(dtype).itemsize
        info = Span(dtype, tuple(int(d) for d in shape), position, position + size)
        document[name] = {"dtype": dtype, "shape": list(info.shape), "data_offsets": [info.begin, info.end]}
        spans.append((name, info))
        position += size
    raw = json.dumps(document, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


class StreamingWriter:
    """Write one safetensors file whose header is known up front; data arrives in pieces.

    Usage::

        with StreamingWriter(path, entries, metadata={"format": "pt"}) as w:
            for name, info in w.order:        # the order data must be written in
                w.write(piece)                # any number of pieces per tensor, in order

    `close()` checks every byte was written, fsyncs and closes. On an exception inside the
    `with` block the partial file is removed.
    """

    def __init__(self, path: str | Path, entries: list[tuple[str, str, tuple[int, ...]]], *,
                 metadata: dict[str, str] | None = None, write_behind: bool = False):
        self.path = Path(path)
        header, self.order = layout_header(entries, metadata)
        self.size = len(header) + sum(info.nbytes for _, info in self.order)
        self._file = open(self.path, "wb", buffering=0)
        self._written = 0
        self._flushed = 0  # bytes whose writeback was started (write_behind)
        self._write_behind = write_behind and hasattr(os, "posix_fadvise")
        self._write_all(header)

    def _write_all(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            count = self._file.write(view)
            view = view[count:]
            self._written += count
        if self._write_behind and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            os.posix_fadvise(self._file.fileno(), self._flushed, self._written - self._flushed, os.POSIX_FADV_DONTNEED)
            self._flushed = self._written

    def write(self, data) -> None:
        """Append data bytes (anything exposing the buffer protocol)."""
        if self._written + memoryview(data).nbytes > self.size:
            raise ValueError(f"{self.path}: writing past the {self.size} bytes the header announced")
        self._write_all(data)

    def close(self) -> int:
        if self._file.closed:
            return self.size
        if self._written != self.size:
            self._file.close()
            raise ValueError(f"{self.path}: wrote {self._written} bytes, the header announced {self.size}")
        os.fsync(self._file.fileno())
        self._file.close()
        return self.size

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass(frozen=True)
class FragmentBytes:
    """One fragment to store: the tensor's name and whole shape, the element range of its
    flat form held here, the safetensors dtype, and exactly those elements' bytes."""

    name: str
    shape: tuple[int, ...]
    range: ElementRange
    dtype: str
    data: memoryview


@dataclass(frozen=True)
class WrittenFragment:
    name: str
    shape: tuple[int, ...]
    dtype: str
    range: ElementRange
    crc32: int


@dataclass(frozen=True)
class WrittenFile:
    name: str
    size: int
    fragments: tuple[WrittenFragment, ...]


def write_rank_file(directory: str | Path, *, rank: int, world_size: int, fragments: Iterable[FragmentBytes]) -> WrittenFile:
    """Write `rank-0000r-of-0000W.safetensors` in `directory` (fsynced). Empty ranges are
    recorded (so a zero-element tensor still gets a manifest entry) and never stored."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    items = list(fragments)
    names = [f.name for f in items]
    if len(set(names)) != len(names):
        raise ValueError(f"rank {rank} has two fragments of one tensor: {sorted({n for n in names if names.count(n) > 1})[:3]}")
    for f in items:
        if f.data.nbytes != f.range.size * dtype_info(f.dtype).itemsize or f.range.end > numel(f.shape):
            raise ValueError(f"fragment of {f.name!r}: {f.data.nbytes} bytes of {f.dtype} for [{f.range.start}, {f.range.end}) "
                             f"of a tensor of shape {list(f.shape)}")
    file_name = rank_file_name(rank, world_size)
    stored = {f.name: f for f in items if f.range.size}
    crcs = {}
    with StreamingWriter(Path(directory) / file_name, [(f.name, f.dtype, (f.range.size,)) for f in stored.values()],
                         metadata={"format": "pt"}) as writer:
        for name, _ in writer.order:
            data = stored[name].data
            crcs[name] = zlib.crc32(data)
            writer.write(data)
    return WrittenFile(file_name, writer.size, tuple(WrittenFragment(f.name, tuple(f.shape), f.dtype, f.range, crcs.get(f.name, 0))
                                                    for f in items))


def write_sharded(directory: Path, *, sources: list[SourceTensor], placement: Placement, world_size: int, strategy: str,
                  training_state: dict, aliases: dict[str, str], cast_to: str | None, copier: ByteCopier) -> Manifest:
    by_name = {source.name: source for source in sources}
    contents = rank_contents(placement, [(s.name, s.shape) for s in sources], world_size)
    fragments: dict[str, list[FragmentEntry]] = {source.name: [] for source in sources}
    files = []
    for rank in range(world_size):
        file_name = rank_file_name(rank, world_size)
        ranges = dict(contents[rank])
        entries = [(name, output_dtype(by_name[name].dtype, cast_to), (rng.size,)) for name, rng in contents[rank]]
        with StreamingWriter(directory / file_name, entries, metadata={"format": "pt"}, write_behind=True) as writer:
            for name, info in writer.order:
                crc = copier.copy(by_name[name], ranges[name], info.dtype, writer.write, checksum=True)
                rng = ranges[name]
                fragments[name].append(FragmentEntry(file_name, name, rng.start, rng.end, crc))
        files.append(FileEntry(file_name, writer.size))
    tensors = tuple(TensorEntry(s.name, s.shape, output_dtype(s.dtype, cast_to),
                                tuple(sorted(fragments[s.name], key=lambda f: f.start))) for s in sources)
    manifest = Manifest(world_size, strategy, placement, tuple(files), tensors, dict(aliases), dict(training_state))
    problems = manifest_problems(manifest)
    if problems:
        raise AssertionError(f"wrote an inconsistent manifest: {problems[0]}")
    copier.finish()
    save_manifest(directory, manifest)
    return manifest
