"""The one reader of checkpoint files (no torch): safetensors headers, sharded checkpoints,
full (Hugging Face style) checkpoints, each validated before a data byte is used.

Safetensors (huggingface/safetensors): 8 bytes little-endian u64 N, N bytes of JSON header
(`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`),
then the byte buffer, which the offsets index with no holes. `read_header(path)` checks
header length against the file size and the 100 MB limit, the JSON, every dtype, that each
tensor's byte span equals numel * itemsize, that the spans tile the buffer exactly and that
the file ends where the buffer does.

Sharded: `open_sharded(path)` resolves `path` (run or step directory), loads the manifest,
reads and validates every data file's header (size equal to the manifest's, spans tiling the
file) and checks each fragment against its file (key present, dtype equal, shape equal to
[end - start], no unreferenced keys). `check_files` returns the same findings as a list (for
`verify`). `ShardedCheckpoint.sources()` gives the `SourceTensor`s that `ByteCopier` reads.

Full: `model.safetensors`, or `model-0000k-of-0000N.safetensors` plus
`model.safetensors.index.json` = `{"metadata": {"total_size": N}, "weight_map": {name: file}}`;
optimizer state likewise under `optimizer*`; tied weights stored once, with
`{"fsdpkit_tied_weights": JSON {alias: stored name}}` in the metadata. `open_full(path)`
accepts a directory holding either layout, a `.safetensors` file or an index file, validates
every header and the index, and returns the tensors as `SourceTensor`s (no checksums: full
files carry none).

Every problem is a `DataCheckError` naming the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import DataCheckError
from ..layout import ElementRange
from .bytecopy import SourcePiece, SourceTensor
from .format import (MAX_HEADER_BYTES, MODEL_INDEX, MODEL_SINGLE, OPTIM_INDEX, OPTIM_SINGLE, TIED_METADATA_KEY,
                     dtype_info, is_known_dtype, is_safe_file_name, numel)
from .manifest import Manifest, load_manifest
from .storage import checkpoint_file, resolve_checkpoint


# ----- safetensors headers
@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # absolute file offset of the data buffer
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def file_size(self) -> int:
        return self.data_start + max((t.end for t in self.tensors.values()), default=0)


def read_header(path: str | Path, *, expected_size: int | None = None) -> Header:
    """Parse and validate the header of a safetensors file (see the module docstring)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise DataCheckError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise DataCheckError(f"{path}: header claims {header_len} bytes, over the {MAX_HEADER_BYTES}-byte limit")
            if 8 + header_len > size:
                raise DataCheckError(f"{path}: header claims {header_len} bytes but the file has only {size} bytes")
            raw = f.read(header_len)
    except FileNotFoundError:
        raise DataCheckError(f"{path}: file is missing") from None
    except IsADirectoryError:
        raise DataCheckError(f"{path}: is a directory, expected a safetensors file") from None
    except PermissionError as error:
        raise DataCheckError(f"{path}: cannot read ({error.strerror})") from None
    if expected_size is not None and size != expected_size:
        raise DataCheckError(f"{path}: file is {size} bytes, the manifest says {expected_size}")
    header = parse_header_bytes(raw, path=path)
    end = header.file_size
    if end != size:
        raise DataCheckError(f"{path}: data ends at byte {end} but the file is {size} bytes (truncated or extended)")
    return header


def parse_header_bytes(raw: bytes, *, path: Path) -> Header:
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as error:
        raise DataCheckError(f"{path}: safetensors header is not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise DataCheckError(f"{path}: safetensors header is a {type(document).__name__}, expected an object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise DataCheckError(f"{path}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in document.items():
        tensors[name] = _tensor_info(name, entry, path)
    spans = sorted((t.begin, t.end, name) for name, t in tensors.items())
    position = 0
    for begin, end, name in spans:
        if begin != position:
            raise DataCheckError(f"{path}: tensor {name!r} starts at byte {begin}, expected {position} (hole or overlap)")
        position = end
    return Header(path=path, data_start=8 + len(raw), tensors=tensors, metadata=dict(metadata))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        duplicates = sorted({key for key in keys if keys.count(key) > 1})
        raise ValueError(f"duplicate keys {duplicates[:3]}")
    return dict(pairs)


def _tensor_info(name: str, entry: object, path: Path) -> TensorInfo:
    if not isinstance(entry, dict):
        raise DataCheckError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not is_known_dtype(dtype):
        raise DataCheckError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise DataCheckError(f"{path}: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise DataCheckError(f"{path}: tensor {name!r} has invalid data_offsets {offsets!r}")
    expected = numel(shape) * dtype_info(dtype).itemsize
    if offsets[1] - offsets[0] != expected:
        raise DataCheckError(
            f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


# ----- sharded checkpoints
@dataclass(frozen=True)
class ShardedCheckpoint:
    step_dir: Path
    manifest: Manifest
    headers: dict[str, Header]  # file name -> validated header

    def sources(self, *, include=lambda entry: True) -> list[SourceTensor]:
        result = []
        for tensor in self.manifest.tensors:
            if not include(tensor):
                continue
            itemsize = dtype_info(tensor.dtype).itemsize
            pieces = []
            for frag in tensor.fragments:
                header = self.headers[frag.file]
                info = header.tensors[frag.key]
                pieces.append(SourcePiece(range=frag.range, path=header.path, offset=header.data_start + info.begin,
                                          nbytes=frag.range.size * itemsize, crc32=frag.crc32,
                                          label=f"{frag.file} key {frag.key!r} [{frag.start}, {frag.end})"))
            result.append(SourceTensor(tensor.name, tensor.shape, tensor.dtype, tuple(pieces)))
        return result


def open_sharded(path: str | Path) -> ShardedCheckpoint:
    step_dir = resolve_checkpoint(path)
    manifest = load_manifest(step_dir)
    headers, problems = check_files(step_dir, manifest)
    if problems:
        more = f" (and {len(problems) - 1} more problems; run fsdpkit verify)" if len(problems) > 1 else ""
        raise DataCheckError(problems[0] + more)
    return ShardedCheckpoint(step_dir, manifest, headers)


def check_files(step_dir: Path, manifest: Manifest) -> tuple[dict[str, Header], list[str]]:
    """Validated headers of the files that passed, and one line per problem found."""
    headers: dict[str, Header] = {}
    problems: list[str] = []
    for entry in manifest.files:
        try:
            path = checkpoint_file(step_dir, entry.name)
            headers[entry.name] = read_header(path, expected_size=entry.size)
        except DataCheckError as error:
            problems.append(str(error))
    referenced: dict[str, set[str]] = {name: set() for name in headers}
    for tensor in manifest.tensors:
        for frag in tensor.fragments:
            header = headers.get(frag.file)
            if header is None:
                continue  # already reported
            referenced[frag.file].add(frag.key)
            info = header.tensors.get(frag.key)
            where = f"{header.path}: key {frag.key!r} (tensor {tensor.name!r} [{frag.start}, {frag.end}))"
            if info is None:
                problems.append(f"{where} is missing from the file")
            elif info.dtype != tensor.dtype:
                problems.append(f"{where} has dtype {info.dtype}, the manifest says {tensor.dtype}")
            elif info.shape != (frag.end - frag.start,):
                problems.append(f"{where} has shape {list(info.shape)}, the manifest says [{frag.end - frag.start}]")
    for name, header in headers.items():
        extra = sorted(set(header.tensors) - referenced[name])
        if extra:
            problems.append(f"{header.path}: keys {extra[:3]} are not in the manifest")
    return headers, problems


# ----- full checkpoints
@dataclass(frozen=True)
class FullCheckpoint:
    root: Path
    files: tuple[Path, ...]
    tensors: tuple[SourceTensor, ...]
    aliases: dict[str, str]


def is_full_checkpoint(path: Path) -> bool:
    return (path.is_file() and path.suffix in (".safetensors", ".json")) or (
        path.is_dir() and ((path / MODEL_SINGLE).is_file() or (path / MODEL_INDEX).is_file()))


def open_full(path: str | Path, *, with_optimizer: bool = False) -> FullCheckpoint:
    path = Path(path)
    if not path.exists():
        raise DataCheckError(f"{path}: does not exist")
    if path.is_file():
        root = path.parent
        files = _index_files(path) if path.name.endswith(".json") else [path]
    elif (path / MODEL_INDEX).is_file():
        root, files = path, _index_files(path / MODEL_INDEX)
    elif (path / MODEL_SINGLE).is_file():
        root, files = path, [path / MODEL_SINGLE]
    else:
        raise DataCheckError(f"{path}: not a full safetensors checkpoint (no {MODEL_SINGLE}, no {MODEL_INDEX})")
    if with_optimizer:
        if (root / OPTIM_INDEX).is_file():
            files += _index_files(root / OPTIM_INDEX)
        elif (root / OPTIM_SINGLE).is_file():
            files.append(root / OPTIM_SINGLE)
        else:
            raise DataCheckError(f"{root}: --with-optimizer given but there is no {OPTIM_SINGLE} or {OPTIM_INDEX}")
    tensors, aliases, seen = [], {}, {}
    for file in files:
        header = read_header(file)
        aliases.update(_tied(header))
        for name, info in header.tensors.items():
            if name in seen:
                raise DataCheckError(f"{file}: tensor {name!r} is also in {seen[name]}")
            seen[name] = file
            piece = SourcePiece(range=ElementRange(0, info.nbytes // dtype_info(info.dtype).itemsize), path=file,
                                offset=header.data_start + info.begin, nbytes=info.nbytes, crc32=None,
                                label=f"{file.name} tensor {name!r}")
            tensors.append(SourceTensor(name, info.shape, info.dtype, (piece,) if info.nbytes else ()))
    return FullCheckpoint(root, tuple(files), tuple(tensors), aliases)


def _index_files(index_path: Path) -> list[Path]:
    try:
        document = json.loads(index_path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataCheckError(f"{index_path}: not a readable JSON index ({error})") from None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise DataCheckError(f"{index_path}: no weight_map object")
    names = []
    for tensor, file in weight_map.items():
        if not is_safe_file_name(file):
            raise DataCheckError(f"{index_path}: tensor {tensor!r} maps to {file!r}, not a file name inside the directory")
        if file not in names:
            names.append(file)
    files = [index_path.parent / name for name in names]
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
    try:
        aliases = json.loads(raw)
    except ValueError:
        raise DataCheckError(f"{header.path}: metadata {TIED_METADATA_KEY} is not JSON") from None
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise DataCheckError(f"{header.path}: metadata {TIED_METADATA_KEY} must map names to names")
    return aliases
