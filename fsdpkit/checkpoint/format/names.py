"""Names and constants of fsdpkit's own checkpoint format: its manifest, `latest`, step
directories, rank files and strategies (pure: no I/O, no torch)."""

from __future__ import annotations

import re

from ..core.names import STEP_PREFIX

FORMAT_NAME = "fsdpkit-checkpoint"
FORMAT_VERSION = 2  # what is written; version 1 is still read
READ_VERSIONS = (1, 2)

MANIFEST_NAME = "manifest.json"
LATEST_NAME = "latest"

# Sharded checkpoints (v2): the one file naming rule, and the rank file metadata key that holds
# each fragment's crc32 (8 lowercase hex digits per fragment, in data order).
RANK_FILE_RULE = "rank-{rank:05d}-of-{world_size:05d}.safetensors"
CRC_METADATA_KEY = "fsdpkit_crc32"

# The sharding strategy of the run that saved a checkpoint, spelled as the engine spells it.
STRATEGIES = ("full", "grad-op", "hybrid", "none")
LEGACY_STRATEGIES = {"full_shard": "full"}  # how convert spelled "full" before

MAX_MANIFEST_BYTES = 1_000_000_000  # v2 manifests stay far below 1 MB; v1 ones grow with the world size

_STEP_NAME = re.compile(r"^step-(\d{8,})$")


def rank_file_name(rank: int, world_size: int) -> str:
    return RANK_FILE_RULE.format(rank=rank, world_size=world_size)


def step_dir_name(step: int) -> str:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step_dir_name(name: str) -> int | None:
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None
