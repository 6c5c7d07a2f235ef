"""The staging area of a spread conversion to an object-store URL: every rank writes into the
bucket itself, no shared filesystem.

    s3://bucket/DST/
      .fsdpkit-writing                          the marker of a write under way, rank 0's lease (`storage.lease`)
      model-00001-of-00004.safetensors ...      the output files, each uploaded by the rank that wrote it
      .fsdpkit-spread/plan.json                 what is being written (its fingerprint)
      .fsdpkit-spread/token                     what every rank must read to know it sees this bucket
      .fsdpkit-spread/done/00001-00000.json     one record per file uploaded, with its crc32

One object cannot be written by two processes, so each output file is written whole by one rank
(`bucket_plan`): the rank writes it as the one-process command does (`to_storage`: streamed as
a multipart upload, a rank file of fsdpkit's format spooled locally first), then records it. Rank 0 commits last: the commit
files (manifest, `.metadata`, `latest`, index) through `storage.upload.publish`, the commit
object alone and last, then the staging objects and the marker go. Until then no reader takes
the prefix for a checkpoint (it has no commit object), and a one-process write to DST replaces
what a killed run left without --overwrite, as it does after a killed one-process write. A rerun
of the same command keeps the recorded files whose objects are there; `--restart` discards the
records. A data file that is itself a commit object (a single-file `model.safetensors`) is
written by rank 0 and uploaded with the commit."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...errors import FsdpkitError, UsageError
from ..storage.face import Storage
from ..storage.lease import WriterLease
from ..storage.location import is_url, open_storage
from ..storage.upload import COMMIT_NAMES, check_destination, claim_destination, publish
from .plan import OutputFile, Part, Plan, make_plan
from .staging import DONE_DIR, PLAN_NAME, STATE_DIR, TOKEN_NAME, PartResult, Staging
from .to_storage import write_planned_file

WHOLE_FILES = "the destination is a bucket: each output file is written whole by one rank (one object is written by one process)"


def bucket_plan(files: list[OutputFile], world_size: int) -> Plan:
    """The plan of a conversion to a bucket: whole files only, a data file that is the commit
    object on rank 0 (which uploads it last); the note says so."""
    plan = make_plan([replace(f, cuts=(), why_whole="") for f in files], world_size)
    owners = tuple(0 if plan.files[part.file].name in COMMIT_NAMES else owner for part, owner in zip(plan.parts, plan.owners, strict=True))
    return Plan(plan.world_size, plan.files, plan.parts, owners, (*plan.notes, WHOLE_FILES) if world_size > 1 else plan.notes)


@dataclass
class BucketStaging:
    """The staging objects under `url` (see the module docstring), and this rank's local scratch."""

    url: str
    storage: Storage = field(init=False)
    lease: WriterLease | None = field(default=None, init=False)  # rank 0's, from `prepare_bucket` to the commit
    _scratch: Path | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.storage = open_storage(self.url)

    @property
    def where(self) -> str:
        return self.storage.where(STATE_DIR)

    @property
    def path(self) -> Path:
        """The local directory this rank writes a file into before uploading it."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="fsdpkit-upload-scratch-"))
        return self._scratch

    def write_state(self, name: str, text: str) -> None:
        self.storage.put(f"{STATE_DIR}/{name}", text.encode())

    def read_state(self, name: str) -> str | None:
        """State object `name`; None when this process does not see it."""
        try:
            return self.storage.read(f"{STATE_DIR}/{name}").decode()
        except FsdpkitError:
            return None

    def token(self) -> str | None:
        found = self.read_state(TOKEN_NAME)
        return found.strip() if found is not None else None

    def write_part(self, job: Any, part: Part, progress: Callable[[int], None]) -> PartResult:
        """File `part.file` (whole) written into the bucket as `to_storage` writes one: streamed,
        or a rank file spooled and uploaded; a data file that is the commit object into the local
        scratch, uploaded with the commit."""
        if job.files[part.file].name in COMMIT_NAMES:
            return job.run_part(part, self.path, progress)
        return write_planned_file(job, part.file, self.storage, progress)

    def record(self, result: PartResult) -> None:
        """Record the file `result` names, its object complete (`write_part`). The commit object
        is not recorded: it is written with the commit."""
        if result.name in COMMIT_NAMES:
            return
        self.write_state(f"{DONE_DIR}/{result.file:05d}-{result.index:05d}.json", json.dumps(asdict(result)))

    def records(self) -> dict[tuple[int, int], PartResult]:
        """The files recorded as uploaded whose objects are still there and long enough."""
        listed = self.storage.list()
        found = {}
        for name in sorted(n for n in listed if n.startswith(f"{STATE_DIR}/{DONE_DIR}/")):
            try:
                result = PartResult(**json.loads(self.storage.read(name)))
            except (FsdpkitError, ValueError, TypeError):
                continue
            if listed.get(result.name, -1) >= result.end:
                found[(result.file, result.index)] = result
        return found

    def commit_job(self, job: Any, done: list[PartResult], dst: str, *, overwrite: bool) -> Any:
        """Rank 0: the job's commit files written here, then published, the commit object last;
        the staging objects and the marker removed after it (DST's old checkpoint, with
        --overwrite, lost its commit object when the run began)."""
        listed = self.storage.list()
        if not overwrite and (found := [name for name in COMMIT_NAMES if name in listed]):
            raise UsageError(f"{self.storage.where(found[0])} appeared while the conversion ran; pass --overwrite to replace it")
        report = job.commit(self.path, done, dst)
        data = {f.name for f in job.files if f.name not in COMMIT_NAMES}
        assert self.lease is not None, "rank 0 commits through the staging it prepared"
        publish(self.path, self.storage, {name: size for name, size in listed.items() if name not in data}, self.lease)
        return replace(report, dst=dst) if not isinstance(report, dict) else report

    def close(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def check_bucket(url: str, *, digest: str, overwrite: bool, restart: bool) -> BucketStaging:
    """Every check `prepare_bucket` makes before it writes, writing nothing: the staging objects at `url`."""
    staging = BucketStaging(url)
    _check_staged(staging, check_destination(staging.storage, overwrite=overwrite), digest=digest, restart=restart)
    return staging


def _check_staged(staging: BucketStaging, existing: dict[str, int], *, digest: str, restart: bool) -> None:
    """A UsageError when the staging objects among `existing` are another conversion's (without `restart`)."""
    found = staging.read_state(PLAN_NAME) if f"{STATE_DIR}/{PLAN_NAME}" in existing else None
    if found is not None and not restart and json.loads(found).get("fingerprint") != digest:
        raise UsageError(
            f"{staging.where} holds the partial output of another conversion (other source or options): pass --restart to discard it"
        )


def prepare_bucket(url: str, *, digest: str, overwrite: bool, restart: bool, held: contextlib.ExitStack) -> BucketStaging:
    """Rank 0: the staging objects of the conversion `digest` at `url`, found again (`restart`:
    discarded), with a new token, under the writer's lease, held until the commit or until `held`
    closes; an old checkpoint there (with --overwrite) loses its commit object before anything
    is written."""
    staging = BucketStaging(url)
    staging.lease, existing = claim_destination(
        staging.storage, overwrite=overwrite, check=lambda existing: _check_staged(staging, existing, digest=digest, restart=restart)
    )
    held.enter_context(staging.lease)
    state = [name for name in existing if name.startswith(f"{STATE_DIR}/")]
    staging.storage.delete([name for name in COMMIT_NAMES if name in existing] + (state if restart else []))
    staging.write_state(PLAN_NAME, json.dumps({"fingerprint": digest}) + "\n")
    staging.write_state(TOKEN_NAME, uuid.uuid4().hex + "\n")
    return staging


def staging_at(location: str) -> Staging | BucketStaging:
    """The staging area rank 0 named: a local directory, or the destination URL's staging objects."""
    return BucketStaging(location) if is_url(location) else Staging(Path(location))
