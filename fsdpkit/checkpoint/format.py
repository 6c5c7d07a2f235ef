"""Names and constants of the fsdpkit checkpoint format (no I/O, no torch).

The spec is docs/checkpoint-format.md. Everything here is pure and shared by the writer,
the readers, convert, reshard, verify and inspect.
"""

from __future__ import annotations

import json
import math
import re
from typing import TypeGuard

from ..dtypes import dtype_info
from ..errors import DataCheckError

FORMAT_NAME = "fsdpkit-checkpoint"
FORMAT_VERSION = 2  # what is written; version 1 is still read
READ_VERSIONS = (1, 2)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"
STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-"  # in-progress directories: never a checkpoint until renamed

# Full (Hugging Face style) checkpoints.
MODEL_SINGLE = "model.safetensors"
MODEL_INDEX = "model.safetensors.index.json"
OPTIM_SINGLE = "optimizer.safetensors"
OPTIM_INDEX = "optimizer.safetensors.index.json"
TIED_METADATA_KEY = "fsdpkit_tied_weights"  # __metadata__ key: JSON {alias: stored name}

# Sharded checkpoints (v2): the one file naming rule, and the rank file metadata key that holds
# each fragment's crc32 (8 lowercase hex digits per fragment, in data order).
RANK_FILE_RULE = "rank-{rank:05d}-of-{world_size:05d}.safetensors"
CRC_METADATA_KEY = "fsdpkit_crc32"

# The sharding strategy of the run that saved a checkpoint, spelled as the engine spells it.
STRATEGIES = ("full", "grad-op", "hybrid", "none")
LEGACY_STRATEGIES = {"full_shard": "full"}  # how convert spelled "full" before

OPTIM_PREFIX = "optim."  # optimizer state tensors: optim.<state>.<param name>

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
MAX_MANIFEST_BYTES = 1_000_000_000  # v2 manifests stay far below 1 MB; v1 ones grow with the world size
MAX_JSON_DEPTH = 64  # nesting of any JSON document read (manifests, headers, indexes)

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_STEP_NAME = re.compile(r"^step-(\d{8,})$")


def numel(shape: tuple[int, ...] | list[int]) -> int:
    return math.prod(shape)


def nbytes(shape: tuple[int, ...] | list[int], dtype: str) -> int:
    return numel(shape) * dtype_info(dtype).itemsize


def output_dtype(dtype: str, cast_to: str | None) -> str:
    """The dtype a tensor gets on the way out: floats are cast, ints/bools/fp8 are kept."""
    if cast_to is None or not dtype_info(dtype).castable:
        return dtype
    return cast_to


def rank_file_name(rank: int, world_size: int) -> str:
    return RANK_FILE_RULE.format(rank=rank, world_size=world_size)


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


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
    rest = name[len(OPTIM_PREFIX) :]
    state, dot, param = rest.partition(".")
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
        if isinstance(value, dict):
            pending.extend((v, depth + 1) for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            pending.extend((v, depth + 1) for v in value if isinstance(v, (dict, list)))
    return document


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    document = dict(pairs)
    if len(document) != len(pairs):
        keys = [key for key, _ in pairs]
        raise ValueError(f"duplicate keys {sorted({key for key in keys if keys.count(key) > 1})[:3]}")
    return document
