"""DCP checkpoints read through the storage face (an object store): the metadata from
`.metadata`, the chunks' records and headers from ranged reads of the data files, then the
same `verify` and `inspect` as for a local directory."""

from __future__ import annotations

from ...errors import DataCheckError
from ..core.report import VerifyReport
from ..storage.face import Storage
from .inspect import FORMAT, DcpSummary, summarize_opened, verify_opened
from .metadata import MAX_METADATA_BYTES, METADATA_NAME, DcpMetadata, parse_metadata
from .table import DcpCheckpoint


def _metadata(storage: Storage, listed: dict[str, int]) -> DcpMetadata:
    where = storage.where(METADATA_NAME)
    if listed[METADATA_NAME] > MAX_METADATA_BYTES:
        raise DataCheckError(f"{where}: {listed[METADATA_NAME]} bytes, over the {MAX_METADATA_BYTES}-byte limit for DCP metadata")
    return parse_metadata(storage.read(METADATA_NAME), storage.root, where=where)


def verify_stored_dcp(storage: Storage, listed: dict[str, int]) -> VerifyReport:
    report = VerifyReport(storage.root, FORMAT, not_checked=["tensor values (DCP stores no checksums)"])
    try:
        metadata = _metadata(storage, listed)
    except DataCheckError as error:
        return report.failed(str(error))
    with DcpCheckpoint(metadata, storage) as checkpoint:
        return verify_opened(checkpoint, report)


def summarize_stored_dcp(storage: Storage, listed: dict[str, int], *, model_key: str | None, optimizer_key: str | None) -> DcpSummary:
    with DcpCheckpoint(_metadata(storage, listed), storage) as checkpoint:
        problems = checkpoint.structure_problems()
        if problems:
            more = f" (and {len(problems) - 1} more problems; run fsdpkit verify)" if len(problems) > 1 else ""
            raise DataCheckError(problems[0] + more)
        return summarize_opened(checkpoint, model_key=model_key, optimizer_key=optimizer_key)
