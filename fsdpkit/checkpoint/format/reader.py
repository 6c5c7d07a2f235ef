"""The one reader of checkpoint files (no torch): sharded checkpoints (v2 and v1) and full Hugging
Face style ones, as docs/checkpoint-format.md's "Reading", "Version 1" and "Full checkpoints"
say. Every file is opened with `files.open_regular`, inside the checkpoint directory
(`staging.checkpoint_file`), and validated before a data byte of it is used; every problem is a
one-line `DataCheckError` naming the file. A tensor's pieces are computed on demand, so memory
does not grow with world size x tensors.

Safetensors: 8 bytes little-endian u64 N, N bytes of JSON header (`{"name": {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`), then the byte buffer, which the
offsets tile with no holes; the file ends where the buffer does.
"""

from __future__ import annotations

import bisect
import os
import re
import struct
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...dtypes import dtype_info
from ...errors import DataCheckError, UsageError
from ...flat_layout import ElementRange
from ..core.bytecopy import SourcePiece, SourceTensor
from ..core.export import ExportLayout, layout_of
from ..core.files import pread_into, read_blocks, read_exactly, regular_file, source_path
from ..core.names import (
    MAX_HEADER_BYTES,
    MODEL_INDEX,
    MODEL_SINGLE,
    OPTIM_INDEX,
    OPTIM_SINGLE,
    TIED_METADATA_KEY,
    Header,
    is_safe_file_name,
    numel,
    parse_header_bytes,
    parse_json,
)
from ..core.staging import checkpoint_file
from .manifest import FragmentEntry, Manifest, load_manifest
from .names import CRC_METADATA_KEY, MANIFEST_NAME, rank_file_name
from .placement import FileLayout
from .storage import resolve_checkpoint

_HEX = re.compile(rb"[0-9a-f]*")
CACHED_PIECES = 256


def read_header(path: str | Path, *, expected_size: int | None = None) -> Header:
    path = source_path(path)
    with regular_file(path) as (fd, size):
        if expected_size is not None and size != expected_size:
            raise DataCheckError(f"{path}: file is {size} bytes, the manifest says {expected_size}")
        if size < 8:
            raise DataCheckError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", read_exactly(fd, 8, 0, path))
        if header_len > MAX_HEADER_BYTES:
            raise DataCheckError(f"{path}: header claims {header_len} bytes, over the {MAX_HEADER_BYTES}-byte limit")
        if 8 + header_len > size:
            raise DataCheckError(f"{path}: header claims {header_len} bytes but the file has only {size} bytes")
        raw = read_exactly(fd, header_len, 8, path)
    header = parse_header_bytes(raw, path=path)
    if header.file_size != size:
        raise DataCheckError(f"{path}: data ends at byte {header.file_size} but the file is {size} bytes (truncated or extended)")
    return header


class RankFile:
    """A validated rank file: its fragments in data order (tensor index, byte span, crc32) in
    compact arrays (a few dozen bytes per fragment), and a lookup by tensor."""

    def __init__(
        self, path: Path, size: int, data_start: int, tensors: Sequence[int], spans: Sequence[tuple[int, int]], crcs: Sequence[int]
    ):
        self.path, self.size, self.data_start = path, size, data_start
        self.tensors = array("q", tensors)
        self.begins = array("q", [begin for begin, _ in spans])
        self.ends = array("q", [end for _, end in spans])
        self.crcs = array("I", crcs)
        self._sorted: array | None = None  # tensor indices in increasing order, and where each sits (made on first find)
        self._position: array | None = None

    def __len__(self) -> int:
        return len(self.tensors)

    def find(self, tensor: int) -> tuple[int, int]:
        """(absolute file offset, crc32) of `tensor`'s fragment in this file."""
        if self._sorted is None or self._position is None:
            order = sorted(range(len(self.tensors)), key=self.tensors.__getitem__)
            self._sorted, self._position = array("q", [self.tensors[i] for i in order]), array("q", order)
        i = bisect.bisect_left(self._sorted, tensor)
        if i == len(self._sorted) or self._sorted[i] != tensor:
            raise KeyError(tensor)
        position = self._position[i]
        return self.data_start + self.begins[position], self.crcs[position]

    def data_blocks(self, buffer: memoryview) -> Iterator[tuple[int, memoryview]]:
        """The file's data front to back, read into `buffer` one block at a time: (position
        relative to the data buffer, block); each block is valid until the next is read."""
        if not len(self):
            return
        position = self.begins[0]
        for block in read_blocks(self.path, buffer, self.data_start + position, self.data_start + self.ends[-1]):
            yield position, block
            position += len(block)


def v2_crcs(path: str | Path, raw: bytes, expected: FileLayout) -> tuple[int, ...]:
    """The fragments' crc32s from a v2 rank file's header `raw`, which must be exactly the
    header the layout derives except for the crc32 hex digits (else a DataCheckError)."""
    if raw[:8] != expected.header[:8]:
        raise DataCheckError(
            f"{path}: header claims {struct.unpack('<Q', raw[:8])[0]} bytes, the layout the manifest gives has {len(expected.header) - 8}"
        )
    crc_end = expected.crc_offset + 8 * len(expected.tensors)
    if raw[: expected.crc_offset] != expected.header[: expected.crc_offset] or raw[crc_end:] != expected.header[crc_end:]:
        at = next(i for i, (a, b) in enumerate(zip(raw, expected.header, strict=True)) if a != b and not expected.crc_offset <= i < crc_end)
        raise DataCheckError(
            f"{path}: header differs from the layout the manifest gives at byte {at} "
            f"({raw[max(at - 20, 0) : at + 20].decode('ascii', 'replace')!r})"
        )
    digits = raw[expected.crc_offset : crc_end]
    if not _HEX.fullmatch(digits):
        raise DataCheckError(f"{path}: {CRC_METADATA_KEY} holds characters other than lowercase hex digits")
    return struct.unpack(f">{len(expected.tensors)}I", bytes.fromhex(digits.decode("ascii")))


class ShardedCheckpoint:
    def __init__(self, step_dir: Path, manifest: Manifest):
        self.step_dir, self.manifest = step_dir, manifest
        self.layout = manifest.layout() if manifest.listing is None else None
        self._files: dict[int, RankFile] = {}
        self._located: dict[int, list[tuple[int, ElementRange]]] = {}  # tensor -> (file, range) of its fragments: v1 all, v2 few
        self._v1_files = manifest.listing.files if manifest.listing is not None else ()
        self._v1_in_file: list[list[tuple[int, FragmentEntry]]] = [[] for _ in self._v1_files]  # (tensor, fragment) by file
        if manifest.listing is not None:  # v1 lists what v2 derives: indexed here by file and by tensor
            position = {name: i for i, (name, _) in enumerate(self._v1_files)}
            for t, spec in enumerate(manifest.tensors):
                fragments = manifest.listing.fragments[spec.name]
                self._located[t] = [(position[f.file], ElementRange(f.start, f.end)) for f in fragments]
                for frag in fragments:
                    self._v1_in_file[position[frag.file]].append((t, frag))

    def file_names(self) -> list[str]:
        if self.layout is None:
            return [name for name, _ in self._v1_files]
        return [rank_file_name(rank, self.manifest.shard_factor) for rank in range(self.manifest.shard_factor)]

    def rank_file(self, index: int, *, cache: bool = True) -> RankFile:
        """File `index` (a rank in v2, a position in the listing in v1), validated on first use."""
        found = self._files.get(index)
        if found is None:
            found = self._validate_v1(index) if self.layout is None else self._validate_v2(index, self.layout.file_layout(index))
            if cache:
                self._files[index] = found
        return found

    def _validate_v2(self, rank: int, expected: FileLayout) -> RankFile:
        raw = bytearray(len(expected.header))
        path = self._read_v2(rank, expected, memoryview(raw))
        return RankFile(path, expected.size, expected.data_start, expected.tensors, expected.spans, v2_crcs(path, bytes(raw), expected))

    def read_whole_v2(self, rank: int, expected: FileLayout, buffer: memoryview) -> tuple[Path, memoryview]:
        """Rank file `rank` of a v2 checkpoint read whole into `buffer` (at least the size its
        layout derives): (its path, the bytes read)."""
        view = buffer[: expected.size]
        return self._read_v2(rank, expected, view), view

    def _read_v2(self, rank: int, expected: FileLayout, into: memoryview) -> Path:
        """Read the first bytes of rank file `rank`, which must be of the size its layout derives, into `into`."""
        path = checkpoint_file(self.step_dir, rank_file_name(rank, self.manifest.shard_factor))
        with regular_file(path) as (fd, size):
            if size != expected.size:
                raise DataCheckError(
                    f"{path}: file is {size} bytes, the layout the manifest gives has {expected.size} "
                    f"(truncated, extended or from another checkpoint)"
                )
            pread_into(fd, 0, into, path)
        return path

    def _validate_v1(self, index: int) -> RankFile:
        name, size = self._v1_files[index]
        header = read_header(checkpoint_file(self.step_dir, name), expected_size=size)
        entries, keys = [], set()  # (begin, end, tensor, crc32) of each fragment
        for t, frag in self._v1_in_file[index]:
            spec = self.manifest.tensors[t]
            keys.add(frag.key)
            info = header.tensors.get(frag.key)
            where = f"{header.path}: key {frag.key!r} (tensor {spec.name!r} [{frag.start}, {frag.end}))"
            if info is None:
                raise DataCheckError(f"{where} is missing from the file")
            if info.dtype != spec.dtype:
                raise DataCheckError(f"{where} has dtype {info.dtype}, the manifest says {spec.dtype}")
            if info.shape != (frag.end - frag.start,):
                raise DataCheckError(f"{where} has shape {list(info.shape)}, the manifest says [{frag.end - frag.start}]")
            entries.append((info.begin, info.end, t, frag.crc32))
        extra = sorted(set(header.tensors) - keys)
        if extra:
            raise DataCheckError(f"{header.path}: keys {extra[:3]} are not in the manifest")
        entries.sort()
        return RankFile(header.path, size, header.data_start, [e[2] for e in entries], [e[:2] for e in entries], [e[3] for e in entries])

    def check_files(self) -> list[str]:
        """Validate every file (and that the directory holds nothing else); one line per problem."""
        problems = []
        for index in range(len(self.file_names())):
            try:
                self.rank_file(index)
            except DataCheckError as error:
                problems.append(str(error))
        return problems + self.unexpected_files()

    def unexpected_files(self) -> list[str]:
        expected = set(self.file_names()) | {MANIFEST_NAME}
        extra = sorted(entry.name for entry in self.step_dir.iterdir() if entry.name not in expected)
        more = f" (+{len(extra) - 3} more)" if len(extra) > 3 else ""
        return [f"{self.step_dir}: holds files the manifest does not account for: {extra[:3]}{more}"] if extra else []

    def source(self, name: str) -> SourceTensor:
        return _Source(self, self.manifest.tensor_index(name))

    def sources(self) -> list[SourceTensor]:
        return [_Source(self, index) for index in range(len(self.manifest.tensors))]

    def pieces(self, tensor: int, wanted: ElementRange) -> list[SourcePiece]:
        """The pieces of `tensor` that meet `wanted`, in order; only their files are validated
        (and only once). Where the fragments of a tensor of few fragments lie is worked out once;
        for one of many (a large world size), only for the range asked for."""
        located = self._located.get(tensor)
        if located is None:
            assert self.layout is not None  # a v1 checkpoint has every tensor located on opening
            if self.layout.piece_count(tensor) > CACHED_PIECES:
                located = self.layout.pieces(tensor, wanted)
            else:
                located = self._located[tensor] = self.layout.pieces(tensor, None)
        located = [(i, rng) for i, rng in located if rng.start < wanted.end and wanted.start < rng.end]
        spec = self.manifest.tensors[tensor]
        itemsize = dtype_info(spec.dtype).itemsize
        pieces = []
        for index, rng in located:
            rank_file = self.rank_file(index)
            offset, crc = rank_file.find(tensor)
            pieces.append(SourcePiece(rng, rank_file.path, offset, rng.size * itemsize, crc, spec.name))
        return pieces


class _Source(SourceTensor):
    """A tensor of a sharded checkpoint; its pieces are found when a range is asked for."""

    _checkpoint: ShardedCheckpoint  # set through object.__setattr__: SourceTensor is frozen
    _index: int

    def __init__(self, checkpoint: ShardedCheckpoint, index: int):
        spec = checkpoint.manifest.tensors[index]
        super().__init__(spec.name, spec.shape, spec.dtype)
        object.__setattr__(self, "_checkpoint", checkpoint)
        object.__setattr__(self, "_index", index)

    def pieces_in(self, wanted: ElementRange) -> list[SourcePiece]:
        return self._checkpoint.pieces(self._index, wanted) if wanted.size else []


def open_sharded_lazily(path: str | os.PathLike[str]) -> ShardedCheckpoint:
    """A sharded checkpoint (run dir, following `latest`, or step dir) with a validated manifest;
    files are validated as they are first touched."""
    step_dir = resolve_checkpoint(path)
    return ShardedCheckpoint(step_dir, load_manifest(step_dir))


def open_sharded(path: str | os.PathLike[str]) -> ShardedCheckpoint:
    """The same, with every file validated first."""
    checkpoint = open_sharded_lazily(path)
    problems = checkpoint.check_files()
    if problems:
        more = f" (and {len(problems) - 1} more problems; run fsdpkit verify)" if len(problems) > 1 else ""
        raise DataCheckError(problems[0] + more)
    return checkpoint


@dataclass(frozen=True)
class FullCheckpoint:
    root: Path
    files: tuple[Path, ...]
    tensors: tuple[SourceTensor, ...]
    aliases: dict[str, str]
    layout: ExportLayout | None = None  # names/orientation were changed on export (export.py): how to undo it
    metadata: dict[str, str] = field(default_factory=dict)  # the files' `__metadata__`, merged


def is_full_checkpoint(path: Path) -> bool:
    """A `.safetensors` or index file, or a directory holding model.safetensors or its index
    (whatever they are: `open_full` refuses what is not a regular file)."""
    return (not path.is_dir() and path.suffix in (".safetensors", ".json") and path.exists()) or (
        path.is_dir() and ((path / MODEL_SINGLE).exists() or (path / MODEL_INDEX).exists())
    )


def has_optimizer_files(path: Path) -> bool:
    """A full checkpoint (its directory, or a file in it) written with its optimizer state
    (`optimizer.safetensors` or its index beside the model's)."""
    root = path if path.is_dir() else path.parent
    return (root / OPTIM_SINGLE).exists() or (root / OPTIM_INDEX).exists()


def open_full(path: str | os.PathLike[str], *, with_optimizer: bool = False) -> FullCheckpoint:
    path = source_path(path)
    if not path.exists():
        raise UsageError(f"{path}: does not exist")
    if not path.is_dir():
        root = path.parent
        files = _index_files(path) if path.name.endswith(".json") else [path]
    elif (path / MODEL_INDEX).exists():
        root, files = path, _index_files(checkpoint_file(path, MODEL_INDEX))
    elif (path / MODEL_SINGLE).exists():
        root, files = path, [checkpoint_file(path, MODEL_SINGLE)]
    else:
        raise DataCheckError(f"{path}: not a full safetensors checkpoint (no {MODEL_SINGLE}, no {MODEL_INDEX})")
    if with_optimizer:
        if (root / OPTIM_INDEX).exists():
            files += _index_files(checkpoint_file(root, OPTIM_INDEX))
        elif (root / OPTIM_SINGLE).exists():
            files.append(checkpoint_file(root, OPTIM_SINGLE))
        else:
            raise DataCheckError(f"{root}: --with-optimizer given but there is no {OPTIM_SINGLE} or {OPTIM_INDEX}")
    tensors: list[SourceTensor] = []
    aliases: dict[str, str] = {}
    seen: dict[str, Path] = {}  # tensor name -> the file holding it
    layout: ExportLayout | None = None
    metadata: dict[str, str] = {}
    for file in files:
        header = read_header(file)
        metadata.update(header.metadata)
        aliases.update(_tied(header))
        layout = layout or layout_of(header.metadata, where=str(file))
        for name, info in header.tensors.items():
            if name in seen:
                raise DataCheckError(f"{file}: tensor {name!r} is also in {seen[name]}")
            seen[name] = file
            piece = SourcePiece(ElementRange(0, numel(info.shape)), file, header.data_start + info.begin, info.nbytes, None, name)
            tensors.append(SourceTensor(name, info.shape, info.dtype, (piece,) if info.nbytes else ()))
    return FullCheckpoint(root, tuple(files), tuple(tensors), aliases, layout, metadata)


def _index_files(index_path: Path) -> list[Path]:
    with regular_file(index_path) as (fd, size):
        if size > MAX_HEADER_BYTES:
            raise DataCheckError(f"{index_path}: {size} bytes, over the {MAX_HEADER_BYTES}-byte limit for an index")
        raw = read_exactly(fd, size, 0, index_path)
    document = parse_json(raw, where=str(index_path), what="index")
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DataCheckError(f"{index_path}: no weight_map object")
    for tensor, file in weight_map.items():
        if not is_safe_file_name(file):
            raise DataCheckError(f"{index_path}: tensor {tensor!r} maps to {str(file)[:80]!r}, not a file name inside the directory")
    files = [checkpoint_file(index_path.parent, name) for name in dict.fromkeys(weight_map.values())]
    for file in files:
        header = read_header(file)
        listed = {t for t, f in weight_map.items() if f == file.name}
        if listed != set(header.tensors):
            diff = sorted(listed ^ set(header.tensors))
            raise DataCheckError(f"{file}: holds tensors that disagree with {index_path.name}: {diff[:3]}")
    return files


def _tied(header: Header) -> dict[str, str]:
    raw = header.metadata.get(TIED_METADATA_KEY)
    if raw is None:
        return {}
    aliases = parse_json(raw.encode("utf-8"), where=f"{header.path}: metadata {TIED_METADATA_KEY}")
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise DataCheckError(f"{header.path}: metadata {TIED_METADATA_KEY} must map names to names")
    return aliases
