"""The save protocol, every rank taking part (torch collectives through `comm.Collectives`).

1. Rank 0 creates the temporary step directory and broadcasts its path or why it could not.
2. The ranks check, with one all-reduce, that they all see the directory and agree on the
   manifest (a digest of the tensor table and placement).
3. Each rank that writes shards writes its own rank file, fsynced, no gather to rank 0; all
   ranks agree that every file was written: an OSError on any rank (a full disk) fails the save
   on every rank with one RunError naming it, the temporary directory removed.
4. Rank 0 commits (manifest, renames, `latest`, pruning) and broadcasts the result.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...dist import faults
from ...dist.comm import Collectives
from ...errors import RunError
from ...flat_layout import ElementRange
from ..core.crc import crc32
from ..core.staging import os_error_line
from ..format import storage
from ..format.manifest import Manifest
from ..format.names import rank_file_name
from ..format.writer import CacheMode, RankFileWriter
from .tensors import raw_bytes

WRITE_CHUNK_BYTES = 32 * 1024 * 1024  # one os.write and one crc32 update, each without the GIL; fewer pieces, fewer GIL hand-overs


@dataclass
class SaveTimings:
    """Seconds this rank spent on saves so far, summed over `saves` (each field: docs/checkpoints.md)."""

    saves: int = 0
    snapshot: float = 0.0
    checksum: float = 0.0
    write: float = 0.0
    fsync: float = 0.0
    total: float = 0.0


@dataclass(frozen=True)
class SaveJob:
    """One save (`local`: this rank's data, None where it writes no file; `device`: where the
    ranks' flags are reduced)."""

    shard_rank: int
    run_dir: Path | str  # a directory, or an object-store URL (store_save.py)
    step: int
    manifest: Manifest
    local: dict[str, tuple[ElementRange, torch.Tensor]] | None
    keep_last: int | None
    device: torch.device
    writer_started: datetime  # when this process's checkpointer began: an upload under the run initiated earlier is a killed writer's


@dataclass(frozen=True)
class Ranks:
    comm: Collectives
    group: Any
    rank: int

    def min_over_ranks(self, values: list[int], device: torch.device, *, label: str) -> list[int]:
        flags = torch.tensor(values, dtype=torch.int64, device=device)
        self.comm.all_reduce(flags, self.group, op=dist.ReduceOp.MIN, label=label)
        return [int(v) for v in flags.tolist()]

    def from_rank0(self, action: Callable[[], Any], *, where: Path | str, label: str) -> tuple[Any, str | None]:
        """(result, None) of `action` run on rank 0, or (None, why it failed: an OSError on
        `where` or a RunError), on every rank."""
        outcome: tuple[Any, str | None] = (None, None)
        if self.rank == 0:
            try:
                outcome = (action(), None)
            except OSError as error:
                outcome = (None, os_error_line(error, where))
            except RunError as error:
                outcome = (None, str(error))
        return self.comm.broadcast_object(outcome, 0, self.group, label=label)


def run_save(job: SaveJob, ranks: Ranks, timings: SaveTimings) -> str:
    """The protocol above; returns the committed step directory."""
    if isinstance(job.run_dir, str):
        from .store_save import save_to_store

        return save_to_store(job, ranks, timings)
    tmp, failure = ranks.from_rank0(
        lambda: storage.begin(job.run_dir, job.step, run_id=job.manifest.run_id), where=job.run_dir, label="checkpoint directory"
    )
    try:
        if failure:
            raise RunError(f"checkpoint step {job.step} not saved: {failure}")
        check_agreement(job, ranks, visible=tmp.is_dir(), where=tmp)
        failure = None
        if job.local is not None:
            try:
                write_rank(tmp, job.manifest, job.shard_rank, job.local, timings=timings)
                faults.reached("save", job.step)
            except OSError as error:
                failure = os_error_line(error, tmp)
        if ranks.min_over_ranks([1 if failure is None else 0], job.device, label="checkpoint files written") != [1]:
            raise RunError(
                f"checkpoint step {job.step} not saved, previous checkpoint kept: " + (failure or "another rank could not write its file")
            )
        path, failure = ranks.from_rank0(
            lambda: str(storage.commit(tmp, job.run_dir, job.step, job.manifest, keep_last=job.keep_last)),
            where=tmp,
            label="checkpoint committed",
        )
        if failure:
            raise RunError(f"checkpoint step {job.step} not saved, previous checkpoint kept: {failure}")
        return path
    except BaseException:  # a collective failed (a rank died or stopped...): nothing half-written stays
        if tmp is not None and ranks.rank == 0:
            storage.abort(tmp)
        raise


def check_agreement(job: SaveJob, ranks: Ranks, *, visible: bool, where: object) -> None:
    """One all-reduce: every rank sees where the save goes (`visible`) and builds the same tensor
    table and placement; a RunError on every rank otherwise."""
    # 63 bits that every rank must agree on before writing: the tensor table and placement
    text = repr((job.manifest.shard_factor, job.manifest.placement, job.manifest.tensors, sorted(job.manifest.aliases.items())))
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    seen, low, high = ranks.min_over_ranks(
        [1 if visible else 0, digest, -digest], job.device, label="checkpoint directory visible, same tensors"
    )
    if not seen:
        raise RunError(f"save directory {where} is not visible to every rank: --save-dir must be on a filesystem every node sees")
    if low != -high:
        raise RunError(
            f"ranks disagree on what to save at step {job.step} (tensor table or placement differ, "
            f"e.g. optimizer state for different parameters)"
        )


def write_rank(
    directory: Path,
    manifest: Manifest,
    rank: int,
    local: dict[str, tuple[ElementRange, torch.Tensor]],
    *,
    timings: SaveTimings | None = None,
    cache: CacheMode = CacheMode.DIRECT,
) -> int:
    """Write rank `rank`'s file of `manifest` from this rank's data (fsynced), in pieces of
    WRITE_CHUNK_BYTES, adding the time of each part to `timings`. `cache` CACHED where the file
    lives in memory (tmpfs): written with no staging copy. Returns the whole file's crc32."""
    timings = timings if timings is not None else SaveTimings()
    layout = manifest.layout().file_layout(rank)
    path = directory / rank_file_name(rank, manifest.shard_factor)
    with RankFileWriter(path, layout, cache=cache) as writer:
        for fragment in layout.fragments:
            name = manifest.tensors[fragment.tensor].name
            held, data = local[name]
            if not (held.start <= fragment.start and fragment.end <= held.end):
                raise AssertionError(
                    f"{name}: rank {rank} holds [{held.start}, {held.end}), its file needs [{fragment.start}, {fragment.end})"
                )
            started = time.perf_counter()
            payload = raw_bytes(data[fragment.start - held.start : fragment.end - held.start])
            timings.snapshot += time.perf_counter() - started
            crc = 0
            for offset in range(0, payload.nbytes, WRITE_CHUNK_BYTES):
                piece = payload[offset : offset + WRITE_CHUNK_BYTES]
                started = time.perf_counter()
                crc = crc32(piece, crc)
                timings.checksum += time.perf_counter() - started
                writer.write(piece)
            writer.end_fragment(crc)
    timings.write += writer.write_seconds
    timings.fsync += writer.fsync_seconds
    return writer.file_crc32()
