"""Checkpoint locations: a local path, or an object-store URL (`s3://bucket/prefix`,
`gs://bucket/prefix`, `az://container/prefix`), and the one way a command turns either into a
storage face (`open_storage`)."""

from __future__ import annotations

import os
import re
from typing import NamedTuple

from ...errors import UsageError
from .face import Storage

SCHEMES = {"s3": "S3", "gs": "Google Cloud Storage", "az": "Azure Blob Storage"}
_URL = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._-]{1,253}[a-z0-9]$")


class ObjectUrl(NamedTuple):
    scheme: str  # one of SCHEMES
    bucket: str  # the bucket, or Azure's container
    prefix: str  # the key prefix, no leading or trailing "/"; "" for the bucket's root

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def child(self, name: str) -> ObjectUrl:
        return ObjectUrl(self.scheme, self.bucket, f"{self.prefix}/{name}" if self.prefix else name)


def is_url(location: str | os.PathLike[str]) -> bool:
    """`location` names an object store (any `scheme://`), not a local path."""
    return isinstance(location, str) and _URL.match(location) is not None


def parse_url(url: str) -> ObjectUrl:
    """`url` split into scheme, bucket and prefix; a scheme or bucket fsdpkit cannot use is a
    one-line UsageError."""
    match = _URL.match(url)
    if match is None:
        raise UsageError(f"{url}: not an object-store URL (s3://bucket/prefix, gs://bucket/prefix or az://container/prefix)")
    scheme, rest = match.groups()
    if scheme not in SCHEMES:
        raise UsageError(f"{url}: unknown storage scheme {scheme!r}; fsdpkit reads and writes s3://, gs:// and az:// URLs")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise UsageError(f"{url}: no bucket named; write {scheme}://BUCKET/PREFIX")
    if not _BUCKET.match(bucket):
        raise UsageError(f"{url}: {bucket!r} is not a valid bucket name (3-255 lower-case letters, digits, '.', '-', '_')")
    prefix = prefix.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise UsageError(f"{url}: the prefix {prefix!r} has an empty, '.' or '..' part")
    return ObjectUrl(scheme, bucket, prefix)


def open_storage(location: str | os.PathLike[str]) -> Storage:
    """The storage face for a local directory or an object-store URL. The object store needs
    the `cloud` extra; its credentials come from the cloud's own environment and config files."""
    if not is_url(location):
        from .local import LocalStorage

        return LocalStorage(location)
    url = parse_url(str(location))
    from .objects import ObjectStorage

    return ObjectStorage.open(url)
