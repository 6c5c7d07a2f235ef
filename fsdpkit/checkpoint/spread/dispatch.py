"""Which job runs a spread command: `convert` to every format fsdpkit writes, `reshard` of every
format with ranks, `verify` of every format it reads, `diff` of any two checkpoints; a UsageError
in one line for what does not spread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import UsageError
from ..core.request import ConvertRequest, check_count
from ..offline.diff import DiffRequest
from ..offline.formats import DCP, DEEPSPEED, FORMATS, FULL, MEGATRON, SHARDED, convert_target, detect_format
from ..offline.locations import source_at
from .dcp_job import DcpJob, DcpReshardJob, MegatronJob
from .deepspeed_job import DeepSpeedJob, DeepSpeedReshardJob
from .diff_job import DiffJob
from .jobs import FullJob, ReshardJob, VerifyJob
from .sharded_job import ShardedJob
from .verify_jobs import VERIFY_JOBS

CONVERT_JOBS: dict[str, Callable[[str, ConvertRequest], Any]] = {
    FULL: FullJob,
    SHARDED: ShardedJob,
    DCP: DcpJob,
    DEEPSPEED: DeepSpeedJob,
    MEGATRON: MegatronJob,
}
SPREAD_TARGETS = tuple(CONVERT_JOBS)  # what `convert --to` spreads over processes


RESHARD_JOBS: dict[str, Callable[[str, int, int], Any]] = {SHARDED: ReshardJob, DCP: DcpReshardJob, DEEPSPEED: DeepSpeedReshardJob}


def open_job(
    command: str, src: str, *, request: ConvertRequest | DiffRequest | None = None, world_size: int | None = None, chunk_size: int
):
    """The job of a spread command; a UsageError for a format or target that does not spread."""
    if command == "diff":
        assert isinstance(request, DiffRequest)
        return DiffJob(src, request)
    found = detect_format(source_at(src))
    if command == "convert":
        assert isinstance(request, ConvertRequest)
        target = convert_target(found, request)  # every format fsdpkit writes spreads
        return CONVERT_JOBS[target.name](src, request)
    if command == "verify":
        return VerifyJob(src, chunk_size) if found.name == SHARDED else VERIFY_JOBS[found.name](src)
    if not spreads(command, found.name):
        labels = ", ".join(FORMATS[name].label for name in RESHARD_JOBS)
        raise UsageError(f"--nproc-per-node and --nnodes spread {command} of {labels} checkpoints only; {src} is {found.label}")
    check_count("world_size", world_size)
    assert world_size is not None
    return RESHARD_JOBS[found.name](src, world_size, chunk_size)


def spreads(command: str, format_name: str) -> bool:
    """Whether `command` (reshard or verify) of a checkpoint of format `format_name` spreads."""
    return format_name in (RESHARD_JOBS if command == "reshard" else (SHARDED, *VERIFY_JOBS))
