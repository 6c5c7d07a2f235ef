"""The multipart uploads a killed writer left open under a prefix, aborted by the next writer
there (`abort_stale_uploads`): a SIGKILLed process cannot abort its own, and an open upload's
parts are billed until it is aborted. obstore has no call to list or abort another process's
uploads, so these are S3's ListMultipartUploads (`GET /?uploads&prefix=`) and
AbortMultipartUpload (`DELETE /KEY?uploadId=`), signed here (`sigv4.py`).

Only uploads initiated before this writer began are aborted (a second's margin for the
clocks of this machine and the server): the writer holds the run's lock (or finds the marker
of a write cut short), so the others are a killed writer's, never a live one's. An upload
initiated within that second of the writer's start stays open (a lifecycle rule removes it).
GCS and Azure are left alone (docs/object-storage.md says what holds there); so is an S3 store
signed with a web identity or a container role, whose keys only obstore resolves. A sweep that
fails is a warning: the write it precedes goes on."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from ... import log
from ...errors import RunError
from .credentials import s3_access
from .face import Storage
from .location import is_url, parse_url
from .sigv4 import S3Requests

_NAMESPACE = "{http://s3.amazonaws.com/doc/2006-03-01/}"
CLOCK_MARGIN = timedelta(seconds=1)


class OpenUpload(NamedTuple):
    key: str  # the object's whole key in the bucket
    upload_id: str
    initiated: datetime


def abort_stale_uploads(storage: Storage, *, initiated_before: datetime) -> list[str]:
    """Abort the multipart uploads under `storage`'s prefix initiated before `initiated_before`
    (when this writer began); the keys (relative to the prefix) of those aborted."""
    if not is_url(storage.root):
        return []
    url = parse_url(storage.root)
    access = s3_access(url) if url.scheme == "s3" else None
    if access is None:
        return []
    requests, prefix = S3Requests(access, url.bucket), f"{url.prefix}/" if url.prefix else ""
    try:
        stale = stale_uploads(open_uploads(requests, prefix, where=storage.root), initiated_before)
        for upload in stale:
            _abort(requests, upload, where=storage.where(upload.key[len(prefix) :]))
    except (RunError, ElementTree.ParseError, ValueError) as error:
        log.warn(f"{storage.root}: multipart uploads a killed writer left open were not aborted ({error}); a lifecycle rule removes them")
        return []
    return [upload.key[len(prefix) :] for upload in stale]


def stale_uploads(uploads: list[OpenUpload], initiated_before: datetime) -> list[OpenUpload]:
    """The uploads of `uploads` initiated before `initiated_before` (a whole second earlier, so
    that a server clock a little behind this machine's never makes a live writer's look old)."""
    return [upload for upload in uploads if upload.initiated < initiated_before - CLOCK_MARGIN]


def open_uploads(requests: S3Requests, prefix: str, *, where: str) -> list[OpenUpload]:
    """Every multipart upload in progress under key prefix `prefix`, page by page."""
    found: list[OpenUpload] = []
    markers: dict[str, str] = {}
    while True:
        answer = requests.request("GET", "", {"uploads": "", "prefix": prefix, **markers}, what=f"{where}: listing open uploads")
        if answer.status != 200:
            raise RunError(f"{where}: listing open uploads: HTTP {answer.status}")
        document = ElementTree.fromstring(answer.body)
        for upload in document.iter(f"{_NAMESPACE}Upload"):
            key, upload_id, initiated = (upload.findtext(f"{_NAMESPACE}{field}") or "" for field in ("Key", "UploadId", "Initiated"))
            found.append(OpenUpload(key, upload_id, _timestamp(initiated)))
        if document.findtext(f"{_NAMESPACE}IsTruncated") != "true":
            return found
        markers = {
            "key-marker": document.findtext(f"{_NAMESPACE}NextKeyMarker") or "",
            "upload-id-marker": document.findtext(f"{_NAMESPACE}NextUploadIdMarker") or "",
        }


def _abort(requests: S3Requests, upload: OpenUpload, *, where: str) -> None:
    answer = requests.request("DELETE", upload.key, {"uploadId": upload.upload_id}, what=f"{where}: aborting an open upload")
    if answer.status not in (200, 204, 404):  # 404: completed or aborted in between
        raise RunError(f"{where}: aborting an open upload: HTTP {answer.status}")


def _timestamp(text: str) -> datetime:
    """An ISO 8601 time of S3's (`2026-12-07T02:00:00.000Z`), in UTC."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
