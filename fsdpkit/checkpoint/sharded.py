"""Opening a sharded checkpoint without torch: manifest + every file header, cross-checked.

`open_sharded(path)` resolves `path` (run or step directory), loads the manifest, reads and
validates every data file's safetensors header (size equal to the manifest's, spans tiling
the file) and checks each fragment against its file (key present, dtype equal, shape equal
to [end - start], no unreferenced keys). Any problem is a `DataCheckError` naming the file,
raised before a single data byte is read. `check_files` returns the same findings as a list
(for `verify`). `ShardedCheckpoint.sources()` gives the `SourceTensor`s that `streamcopy`
copies from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import DataCheckError
from .format import dtype_info
from .manifest import Manifest, load_manifest
from .paths import checkpoint_file, resolve_checkpoint
from .safetensors_io import Header, read_header
from .streamcopy import SourcePiece, SourceTensor


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

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)


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
