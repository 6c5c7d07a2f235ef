"""Which job runs a spread command: `convert` to every format fsdpkit writes, `reshard` of every
format with ranks, `verify` of every format it reads, `diff` of any two checkpoints; a UsageError
in one line for what does not spread. Each job's module is imported when a run needs it (every
rank imports what it runs, and no other job's readers and writers: a process's start is in
every run's wall time)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ...errors import UsageError
from ..core.request import ConvertRequest, check_count
from ..offline.formats import DCP, DEEPSPEED, FORMATS, FULL, MEGATRON, SHARDED, convert_target, detect_format
from ..offline.locations import source_at
from ..storage.location import is_url

if TYPE_CHECKING:
    from ..core.protocol import Format
    from ..offline.diff import DiffRequest

CONVERT_JOBS: dict[str, str] = {  # the job class, as "module of this package:class"
    FULL: "jobs:FullJob",
    SHARDED: "sharded_job:ShardedJob",
    DCP: "dcp_job:DcpJob",
    DEEPSPEED: "deepspeed_job:DeepSpeedJob",
    MEGATRON: "dcp_job:MegatronJob",
}
SPREAD_TARGETS = tuple(CONVERT_JOBS)  # what `convert --to` spreads over processes


RESHARD_JOBS: dict[str, str] = {SHARDED: "jobs:ReshardJob", DCP: "dcp_job:DcpReshardJob", DEEPSPEED: "deepspeed_job:DeepSpeedReshardJob"}
VERIFY_FORMATS = ("deepspeed", "torch-save-ranks", "dcp", "megatron", "full")  # besides SHARDED: verify_jobs' VERIFY_JOBS


def job_class(where: str) -> Any:
    """The job class at `where` ("module:class", a module of this package), imported now."""
    module, name = where.split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def open_job(
    command: str, src: str, *, request: ConvertRequest | DiffRequest | None = None, world_size: int | None = None, chunk_size: int
):
    """The job of a spread command; a UsageError for a format or target that does not spread."""
    if command == "diff":
        return job_class("diff_job:DiffJob")(src, request)
    found = detect_format(source_at(src))
    if command == "convert":
        assert isinstance(request, ConvertRequest)
        return job_class(_convert_job(found, request))(src, request)
    if command == "verify":
        if found.name == SHARDED:
            return job_class("jobs:VerifyJob")(src, chunk_size)
        return job_class("verify_jobs:VERIFY_JOBS")[found.name](src)
    if not spreads(command, found.name):
        labels = ", ".join(FORMATS[name].label for name in RESHARD_JOBS)
        raise UsageError(f"--nproc-per-node and --nnodes spread {command} of {labels} checkpoints only; {src} is {found.label}")
    check_count("world_size", world_size)
    assert world_size is not None
    return job_class(RESHARD_JOBS[found.name])(src, world_size, chunk_size)


def handed_job_class(command: str, src: str, request: ConvertRequest | DiffRequest | None) -> str | None:
    """The job class ("module:class") of a spread command whose rank 0 hands what it opened to the
    other ranks of its node (they open nothing: `taken`), None when each rank opens the source."""
    if command != "convert" or is_url(src):
        return None
    assert isinstance(request, ConvertRequest)
    found = detect_format(source_at(src))
    where = _convert_job(found, request)
    return where if found.name in getattr(job_class(where), "handed_from", ()) else None


def _convert_job(found: Format, request: ConvertRequest) -> str:
    """The job class ("module:class") of `convert` from a checkpoint of format `found`: every format fsdpkit writes spreads."""
    return CONVERT_JOBS[convert_target(found, request).name]


def spreads(command: str, format_name: str) -> bool:
    """Whether `command` (reshard or verify) of a checkpoint of format `format_name` spreads."""
    return format_name in (RESHARD_JOBS if command == "reshard" else (SHARDED, *VERIFY_FORMATS))
