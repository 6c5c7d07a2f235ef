"""Full (Hugging Face style) safetensors checkpoints: reading, planning output files, index.

Layout: `model.safetensors`, or `model-0000k-of-0000N.safetensors` plus
`model.safetensors.index.json` = `{"metadata": {"total_size": N}, "weight_map": {name: file}}`;
optimizer state likewise under `optimizer*`. Every file has `{"format": "pt"}` metadata; tied
weights are stored once, under their first name, with `{"fsdpkit_tied_weights": JSON
{alias: stored name}}` in the metadata.

`open_full(path, with_optimizer=...)` accepts a directory holding either layout, a
`.safetensors` file or an index file, validates every header and the index, and returns the
tensors as `SourceTensor`s (no checksums: full files carry none). `split_into_files` is the
pure greedy split by `--max-shard-size` (in key order, as huggingface_hub does).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import DataCheckError
from .format import (MODEL_INDEX, MODEL_SINGLE, OPTIM_INDEX, OPTIM_SINGLE, TIED_METADATA_KEY, dtype_info,
                     is_optimizer_tensor, is_safe_file_name, nbytes)
from .safetensors_io import Header, read_header
from .streamcopy import SourcePiece, SourceTensor
from ..layout import ElementRange


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


def split_into_files(tensors: list[tuple[str, str, tuple[int, ...]]], *, prefix: str, max_shard_size: int | None) -> list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]:
    """Greedy split of (name, dtype, shape) in order into files of at most `max_shard_size` bytes
    (a tensor larger than that gets a file of its own). One file is `<prefix>.safetensors`."""
    groups: list[list] = [[]]
    size = 0
    for entry in tensors:
        tensor_bytes = nbytes(entry[2], entry[1])
        if max_shard_size is not None and groups[-1] and size + tensor_bytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        size += tensor_bytes
    if len(groups) == 1:
        return [(f"{prefix}.safetensors", groups[0])]
    count = len(groups)
    return [(f"{prefix}-{i + 1:05d}-of-{count:05d}.safetensors", group) for i, group in enumerate(groups)]


def index_document(files: list[tuple[str, list[tuple[str, str, tuple[int, ...]]]]]) -> dict:
    total = sum(nbytes(shape, dtype) for _, group in files for _, dtype, shape in group)
    return {"metadata": {"total_size": total},
            "weight_map": {name: file for file, group in files for name, _, _ in group}}


def model_and_optimizer(tensors) -> tuple[list, list]:
    model = [t for t in tensors if not is_optimizer_tensor(t.name)]
    optim = [t for t in tensors if is_optimizer_tensor(t.name)]
    return model, optim
