"""Names shared by every checkpoint format: optimizer state tensors (`optim.<state>.<param>`),
safe file names, the files of a full (Hugging Face style) checkpoint, hidden staging directories,
bounded JSON and safetensors headers (pure: no I/O, no torch)."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from ...dtypes import dtype_info, is_known_dtype
from ...errors import DataCheckError
from ..core.files import source_path

DATA_SOURCE_PATH = ("fsdpkit", "data_source")  # a DCP bytes item beside FSDP2's "model" and "optimizer"; dcp.load asks for neither
DATA_SOURCE_KEY = ".".join(DATA_SOURCE_PATH)  # as DCP's metadata flattens it
SCRATCH_NAME = ".fsdpkit-transposed.safetensors"  # tensors transposed back, removed before the output is renamed

STEP_PREFIX = "step-"  # a run directory's step-* directories (fsdpkit's, told apart from DeepSpeed's tags)
TMP_PREFIX = ".tmp-"  # in-progress directories: never a checkpoint until renamed

# Full (Hugging Face style) checkpoints.
MODEL_SINGLE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_SINGLE = "optimizer.safetensors"
OPTIM_INDEX = "optimizer.safetensors.index.json"
TIED_METADATA_KEY = "fsdpkit_tied_weights"  # __metadata__ key: JSON {alias: stored name}

OPTIM_PREFIX = "optim."  # optimizer state tensors: optim.<state>.<param name>

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_JSON_DEPTH = 64  # nesting of any JSON document read (manifests, headers, indexes)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")


def numel(shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape)


def nbytes(shape: tuple[int, ...] | list[int], dtype: str) -> int:
    return numel(shape) * dtype_info(dtype).itemsize


def output_dtype(dtype: str, cast_to: str | None) -> str:
    """The dtype a tensor gets on the way out: floats are cast, ints/bools/fp8 are kept."""
    return dtype if cast_to is None or not dtype_info(dtype).castable else cast_to


def is_safe_file_name(name: object) -> TypeGuard[str]:
    """A plain name inside the checkpoint directory: no separators, no '..', no leading dot."""
    return isinstance(name, str) and len(name) <= 255 and bool(_SAFE_NAME.match(name)) and ".." not in name


def is_optimizer_tensor(name: str) -> bool:
    return name.startswith(OPTIM_PREFIX)


def optim_tensor_name(state: str, param_name: str) -> str:
    """`optim.<state>.<param>`, e.g. optim.exp_avg.h.0.attn.weight. State names have no dots."""
    if "." in state or not state:
        raise ValueError(f"optimizer state name {state!r} must be non-empty and contain no '.'")
    return f"{OPTIM_PREFIX}{state}.{param_name}"


def split_optim_tensor_name(name: str) -> tuple[str, str] | None:
    """(state, param name) of `optim.<state>.<param>`, or None for a scalar/other tensor."""
    if not is_optimizer_tensor(name):
        return None
    state, dot, param = name[len(OPTIM_PREFIX) :].partition(".")
    return (state, param) if dot and state and param else None


def parse_json(raw: bytes, *, where: str, what: str = "JSON") -> object:
    """A JSON document from bytes, nested at most MAX_JSON_DEPTH deep; anything else is a
    one-line DataCheckError naming `where` (never a RecursionError)."""
    try:
        document = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except RecursionError:
        raise DataCheckError(f"{where}: {what} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as error:
        raise DataCheckError(f"{where}: {what} is not valid JSON ({str(error)[:120]})") from None
    pending = [(document, 1)]
    while pending:
        value, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise DataCheckError(f"{where}: {what} is nested deeper than {MAX_JSON_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        pending.extend((v, depth + 1) for v in children if isinstance(v, (dict, list)))
    return document


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    document = dict(pairs)
    if len(document) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate keys {sorted({key for key in keys if keys.count(key) > 1})[:3]}")
    return document


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


def parse_header_bytes(raw: bytes, *, path: str | Path) -> Header:
    document = parse_json(raw, where=str(path), what="safetensors header")
    if not isinstance(document, dict):
        raise DataCheckError(f"{path}: safetensors header is a {type(document).__name__}, expected an object")
    metadata = document.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise DataCheckError(f"{path}: __metadata__ must map strings to strings")
    tensors = {name: _tensor_info(name, entry, path) for name, entry in document.items()}
    position = 0
    for begin, end, name in sorted((t.begin, t.end, name) for name, t in tensors.items()):
        if begin != position:
            raise DataCheckError(f"{path}: tensor {name!r} starts at byte {begin}, expected {position} (hole or overlap)")
        position = end
    return Header(path=source_path(path), data_start=8 + len(raw), tensors=tensors, metadata=dict(metadata))


def _tensor_info(name: str, entry: object, path: str | Path) -> TensorInfo:
    if not isinstance(entry, dict):
        raise DataCheckError(f"{path}: header entry {name!r} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not is_known_dtype(dtype):
        raise DataCheckError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise DataCheckError(f"{path}: tensor {name!r} has invalid shape {str(shape)[:80]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]:
        raise DataCheckError(f"{path}: tensor {name!r} has invalid data_offsets {str(offsets)[:80]}")
    expected = nbytes(shape, dtype)
    if offsets[1] - offsets[0] != expected:
        raise DataCheckError(f"{path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def layout_header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[str, TensorInfo]]]:
    """The header bytes (length prefix included, padded with spaces to a multiple of 8, as the
    safetensors library does) and each entry's data span, in write order: stably sorted by
    descending itemsize, so every tensor starts aligned."""
    names = [name for name, _, _ in entries]
    if len(set(names)) != len(names) or "__metadata__" in names:
        raise ValueError(f"duplicate or reserved tensor names in one safetensors file: {names}")
    ordered = sorted(entries, key=lambda e: -dtype_info(e[1]).itemsize)  # stable: keeps caller order within a size
    document: dict[str, object] = {}
    if metadata:
        document["__metadata__"] = dict(metadata)
    spans, position = [], 0
    for name, dtype, shape in ordered:
        info = TensorInfo(dtype, tuple(int(d) for d in shape), position, position + nbytes(shape, dtype))
        document[name] = {"dtype": dtype, "shape": list(info.shape), "data_offsets": [info.begin, info.end]}
        spans.append((name, info))
        position = info.end
    raw = json.dumps(document, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans
