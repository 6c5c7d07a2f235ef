"""The save protocol (save_protocol.py) into an object store (`--save-dir s3://bucket/prefix`),
every rank taking part; no rename anywhere (format/run_store.py):

1. Rank 0 aborts the multipart uploads a killed writer left open under the run (initiated
   before this process's checkpointer began: none of this run's own is in flight between saves,
   and the lock keeps other runs out), clears what an earlier save of the same step left (its
   manifest first) and broadcasts whether it could.
2. The ranks agree, with one all-reduce, on the manifest (a digest of the tensor table and
   placement).
3. Each rank that writes shards streams its own rank file into the store from the bytes it
   holds (the host buffers an async save copied into, or the parameters and optimizer state of a
   synchronous one): a multipart upload, PARTS_IN_FLIGHT parts at once, aborted on an error. The
   ranks gather what failed; a failure on any rank fails the save on every rank with one
   RunError naming the object and the reason, and nothing is committed.
4. Rank 0 commits: the step's manifest, then `latest`, then keep-last-k.

A save cut short leaves objects under a step that has no manifest: no reader or `--resume` takes
them for a checkpoint, and the next commit (or a restart) removes them.
"""

from __future__ import annotations

import time

import torch

from ...dist import faults
from ...errors import FsdpkitError, RunError
from ...flat_layout import ElementRange
from ..format import run_store
from ..format.manifest import Manifest
from ..format.names import rank_file_name, step_dir_name
from ..storage.face import Storage
from ..storage.location import open_storage
from .save_protocol import Ranks, SaveJob, SaveTimings, check_agreement
from .tensors import raw_bytes


def save_to_store(job: SaveJob, ranks: Ranks, timings: SaveTimings) -> str:
    """The protocol above; returns the committed step's URL."""
    url = str(job.run_dir)
    storage = open_storage(url)
    _, failure = ranks.from_rank0(
        _guarded(lambda: run_store.begin(storage, job.step, writer_started=job.writer_started)), where=url, label="checkpoint prefix"
    )
    if failure:
        raise RunError(f"checkpoint step {job.step} not saved: {failure}")
    check_agreement(job, ranks, visible=True, where=url)
    failure = None
    if job.local is not None:
        try:
            write_rank_object(storage, job.manifest, job.step, job.shard_rank, job.local, timings=timings)
            faults.reached("save", job.step)
        except (FsdpkitError, OSError) as error:
            failure = str(error)
    failures = [line for line in ranks.comm.all_gather_object(failure, ranks.group, label="checkpoint files written") if line]
    if failures:  # every rank names the first object that failed and why
        raise RunError(f"checkpoint step {job.step} not saved, previous checkpoint kept: {failures[0]}")
    path, failure = ranks.from_rank0(
        _guarded(lambda: run_store.commit(storage, job.step, job.manifest, keep_last=job.keep_last)),
        where=url,
        label="checkpoint committed",
    )
    if failure:
        raise RunError(f"checkpoint step {job.step} not saved, previous checkpoint kept: {failure}")
    return path


def _guarded(action):
    """`action`, fsdpkit's errors as RunError (which `Ranks.from_rank0` hands to every rank)."""

    def run():
        try:
            return action()
        except RunError:
            raise
        except FsdpkitError as error:
            raise RunError(str(error)) from None

    return run


def write_rank_object(
    storage: Storage,
    manifest: Manifest,
    step: int,
    rank: int,
    local: dict[str, tuple[ElementRange, torch.Tensor]],
    *,
    timings: SaveTimings,
) -> None:
    """Rank `rank`'s file of `manifest`, streamed into `storage` under step `step` from this rank's data."""
    layout = manifest.layout().file_layout(rank)
    started = time.perf_counter()
    payloads = []
    for fragment in layout.fragments:
        name = manifest.tensors[fragment.tensor].name
        held, data = local[name]
        if not (held.start <= fragment.start and fragment.end <= held.end):
            raise AssertionError(f"{name}: rank {rank} holds [{held.start}, {held.end}), its file needs [{fragment.start}, {fragment.end})")
        payloads.append(raw_bytes(data[fragment.start - held.start : fragment.end - held.start]))
    timings.snapshot += time.perf_counter() - started
    started = time.perf_counter()
    run_store.write_rank_file(storage, f"{step_dir_name(step)}/{rank_file_name(rank, manifest.shard_factor)}", layout, payloads)
    timings.write += time.perf_counter() - started
