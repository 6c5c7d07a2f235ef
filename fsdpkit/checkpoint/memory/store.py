"""A run's snapshots in shared memory (no torch): one directory per node under a tmpfs
(`/dev/shm`), owned by the node's launcher, which outlives the workers that write it.

    <root>/fsdpkit-snapshots-<run tag>-node<N>-<owner pid>/
        owner.json                          host, pid and start time of the owner, the run id
        step-NNNNNNNN/                      a checkpoint directory in the fsdpkit format
            manifest.json
            rank-RRRRR-of-WWWWW.safetensors one rank file (this node's, or a buddy's copy)
            rank-RRRRR-of-WWWWW.snapshot    its header: step, run id, rank, world size, size, crc32

A rank file counts only once its header is there and agrees with it (docs/faults.md): the
header is written last (a temporary file renamed into place), so a file torn by a kill has none.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ...errors import DataCheckError
from ...holder import holder_alive, process_identity, seen_from_here
from ...sizes import format_size
from ..core.crc import crc32
from ..core.files import read_blocks, read_regular
from ..format.manifest import load_manifest
from ..format.names import MANIFEST_NAME, parse_step_dir_name, rank_file_name, step_dir_name

STORE_PREFIX = "fsdpkit-snapshots-"
OWNER_NAME = "owner.json"
HEADER_SUFFIX = ".snapshot"
DEFAULT_ROOT = "/dev/shm"
READ_CHUNK_BYTES = 8 * 1024 * 1024
_RANK_FILE = re.compile(r"^rank-(\d+)-of-\d+\.safetensors")


@dataclass(frozen=True)
class SnapshotHeader:
    """What a snapshot rank file is: written after the file, read before it is trusted."""

    step: int
    run_id: str
    rank: int  # the shard rank whose file this is
    world_size: int  # the shard factor of the run
    size: int
    crc32: int

    def to_bytes(self) -> bytes:
        fields = {"step": self.step, "run": self.run_id, "rank": self.rank, "world_size": self.world_size, "size": self.size}
        return json.dumps({**fields, "crc32": f"{self.crc32:08x}"}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | memoryview) -> SnapshotHeader:
        document = json.loads(bytes(raw).decode())
        if not isinstance(document, dict):
            raise ValueError("not a JSON object")
        return cls(
            int(document["step"]),
            str(document["run"]),
            int(document["rank"]),
            int(document["world_size"]),
            int(document["size"]),
            int(str(document["crc32"]), 16),
        )


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class SnapshotStore:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.run_id: str = json.loads((self.path / OWNER_NAME).read_text())["run"]

    @classmethod
    def create(cls, root: str | Path, *, run_id: str, node_rank: int) -> SnapshotStore:
        """A new, empty store under `root`, owned by this process (OSError where it cannot be made)."""
        identity = process_identity()
        tag = uuid.uuid5(uuid.NAMESPACE_URL, run_id).hex[:8]
        path = Path(root) / f"{STORE_PREFIX}{tag}-node{node_rank}-{identity['pid']}"
        shutil.rmtree(path, ignore_errors=True)  # an earlier process of this pid: it is gone
        path.mkdir(mode=0o700)
        _write_atomically(path / OWNER_NAME, json.dumps({**identity, "run": run_id}).encode())
        return cls(path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def step_dir(self, step: int) -> Path:
        return self.path / step_dir_name(step)

    def begin(self, step: int, manifest: bytes | memoryview | None) -> Path:
        """The directory of `step`, with `manifest` where it has none (every writer writes the same one)."""
        directory = self.step_dir(step)
        directory.mkdir(exist_ok=True)
        if manifest is not None and not (directory / MANIFEST_NAME).is_file():
            _write_atomically(directory / MANIFEST_NAME, bytes(manifest))
        return directory

    def finish(self, step: int, rank: int, world_size: int, crc: int) -> SnapshotHeader:
        """Write the header of rank file `rank` of `step`, last; `crc` as its writer computed it."""
        size = (self.step_dir(step) / rank_file_name(rank, world_size)).stat().st_size
        header = SnapshotHeader(step, self.run_id, rank, world_size, size, crc)
        _write_atomically(self._header_path(step, rank, world_size), header.to_bytes())
        return header

    def put(self, header: SnapshotHeader, data: memoryview | bytes, *, manifest: memoryview | bytes | None = None) -> None:
        """A rank file received from another rank (a buddy's, or for a restore), and its step's manifest."""
        directory = self.begin(header.step, manifest)
        self.discard(header.step, header.rank, header.world_size)
        (directory / rank_file_name(header.rank, header.world_size)).write_bytes(data)
        _write_atomically(self._header_path(header.step, header.rank, header.world_size), header.to_bytes())

    def _header_path(self, step: int, rank: int, world_size: int) -> Path:
        return self.step_dir(step) / (rank_file_name(rank, world_size) + HEADER_SUFFIX)

    def discard(self, step: int, rank: int, world_size: int) -> None:
        """Remove one rank file of a step (header first); the step stays, for the other ranks of
        this node that may be writing theirs into it."""
        self._header_path(step, rank, world_size).unlink(missing_ok=True)
        (self.step_dir(step) / rank_file_name(rank, world_size)).unlink(missing_ok=True)

    def prune_rank(self, rank: int, world_size: int, *, keep_from: int) -> None:
        """Remove rank file `rank` of every step before `keep_from`, and a step left empty."""
        for step in self.steps():
            if step < keep_from:
                self.discard(step, rank, world_size)
                if not self.files(step):  # another rank of this node may be removing it too
                    shutil.rmtree(self.step_dir(step), ignore_errors=True)

    def steps(self) -> list[int]:
        found = [parse_step_dir_name(name) for name in os.listdir(self.path)] if self.path.is_dir() else []
        return sorted(step for step in found if step is not None)

    def files(self, step: int) -> list[int]:
        """The ranks whose rank file (finished or not) `step` holds here."""
        try:
            names = os.listdir(self.step_dir(step))
        except FileNotFoundError:  # removed meanwhile by the last rank of this node that held a file of it
            return []
        return sorted({int(match.group(1)) for name in names if (match := _RANK_FILE.match(name))})

    def header(self, step: int, rank: int, world_size: int) -> SnapshotHeader | None:
        try:
            return SnapshotHeader.from_bytes(self._header_path(step, rank, world_size).read_bytes())
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def refusal(self, step: int, rank: int, world_size: int) -> str | None:
        """Why rank file `rank` of `step` cannot be restored (None: it can): absent, torn (no
        header), another run's, another world size, or bytes that do not match the header."""
        name = rank_file_name(rank, world_size)
        header = self.header(step, rank, world_size)
        if header is None:
            return f"{name} of step {step}: no header (never finished)"
        if header.run_id != self.run_id:
            return f"{name} of step {step}: written by run {header.run_id}, not {self.run_id}"
        if (header.step, header.rank, header.world_size) != (step, rank, world_size):
            return f"{name} of step {step}: its header is for step {header.step}, rank {header.rank} of {header.world_size}"
        crc, size = 0, 0
        try:
            for block in read_blocks(self.step_dir(step) / name, memoryview(bytearray(READ_CHUNK_BYTES))):
                crc = crc32(block, crc)
                size += len(block)
        except DataCheckError as error:
            return f"{name} of step {step}: unreadable ({error})"
        if size != header.size:
            return f"{name} of step {step}: {size} bytes, its header says {header.size}"
        if crc != header.crc32:
            return f"{name} of step {step}: checksum mismatch: stored crc32 {header.crc32:08x}, data gives {crc:08x}"
        try:
            load_manifest(self.step_dir(step))
        except DataCheckError as error:
            return f"{name} of step {step}: {error}"
        return None

    def read(self, step: int, rank: int, world_size: int) -> tuple[SnapshotHeader, bytes]:
        header = self.header(step, rank, world_size)
        if header is None:
            raise FileNotFoundError(f"{self._header_path(step, rank, world_size)}")
        return header, read_regular(self.step_dir(step) / rank_file_name(rank, world_size))


def reclaim_stale(root: str | Path) -> list[Path]:
    """Remove the stores under `root` whose owner no longer runs on this host; returns them.
    A store of another host, or of an owner that cannot be told dead, is kept."""
    removed: list[Path] = []
    for path in Path(root).glob(f"{STORE_PREFIX}*/"):  # directories only
        try:
            owner = json.loads((path / OWNER_NAME).read_text())
        except (OSError, ValueError):
            continue  # being created, or not ours to judge
        if isinstance(owner, dict) and seen_from_here(owner) and not holder_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def room_line(root: str | Path, needed_bytes: int) -> str | None:
    """None when `root` has `needed_bytes` free; else why snapshots are off, in one line."""
    try:
        free = shutil.disk_usage(root).free
    except OSError as error:
        return f"snapshots off: {root} is not usable ({error.strerror}); checkpoints on disk only"
    if free < needed_bytes:
        return (
            f"snapshots off: they need {format_size(needed_bytes)} of shared memory in {root}, "
            f"{format_size(free)} is free; checkpoints on disk only"
        )
    return None
